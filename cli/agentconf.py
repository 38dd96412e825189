"""The agent's settings file: ``/etc/tether/agent.toml`` (or ``--config``), flags over it.

Every key is an ``agent`` option's long name without the dashes (``cpus``, ``memory-mb``, or
``memory_mb``), so the file covers every agent flag, including ones added later, with the
same converters and checks as the command line. Values of the wrong kind, unknown keys and a
file other users could have written (for a root agent) are one-line errors naming the file.
"""

from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Callable
from typing import Any

from tether.cli.errors import CliError
from tether.cli.parser import suggest

DEFAULT_PATH = "/etc/tether/agent.toml"
#: options that are not settings
NOT_SETTINGS = ("help", "config")


def read(path: str, required: bool) -> dict[str, Any]:
    """The file's table, {} if the default file does not exist."""
    import tomllib

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if required:
            raise CliError(f"agent: config file {path} does not exist") from None
        return {}
    except OSError as exc:
        raise CliError(f"agent: cannot read config file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CliError(f"agent: config file {path} is not a regular file")
        if os.geteuid() == 0 and (st.st_uid != 0 or st.st_mode & 0o022):
            # a root agent takes its CPUs, state dir and users from here
            raise CliError(f"agent: config file {path} must be owned by root and writable by "
                           "no one else")
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise CliError(f"agent: config file {path}: {exc}") from None
        except UnicodeDecodeError:
            raise CliError(f"agent: config file {path} is not UTF-8") from None


def given(argv: list[str]) -> set[str]:
    """The long options present on the command line (abbreviations are refused anyway)."""
    return {a.partition("=")[0] for a in argv if a.startswith("--")}


def apply(parser: argparse.ArgumentParser, ns: argparse.Namespace, argv: list[str]) -> None:
    """Fill ``ns`` from the settings file for every option not on the command line."""
    path = ns.config or DEFAULT_PATH
    table = read(path, required=ns.config is not None)
    by_option = {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}
    on_line = given(argv)
    for key, value in table.items():
        if key == "cluster":  # every user's CLI reads this file (client_state_dir)
            raise CliError(f"agent: config file {path}: 'cluster' would put the database's "
                           "password in a file every user reads: give cluster-file = PATH, a "
                           "file only root can read")
        option = "--" + key.replace("_", "-")
        action = by_option.get(option)
        if action is None or key in NOT_SETTINGS:
            known = [o[2:] for o in by_option if o[2:] not in NOT_SETTINGS]
            raise CliError(f"agent: config file {path}: unknown setting {key!r}"
                           f"{suggest(key, known)}")
        if option in on_line:
            continue
        # the state dir ranks below TETHER_STATE_DIR, as for every client (main.state_dir)
        dest = "config_state_dir" if action.dest == "state_dir" else action.dest
        setattr(ns, dest, convert(path, key, action, value))


def settings(ns: argparse.Namespace, state_dir: str) -> dict[str, Any]:
    """Every agent setting in ``ns``, by its option's name without the dashes (``cpus``,
    ``cancel-grace``), and ``state-dir`` as the agent uses it: what a reload compares."""
    from tether.cli.parser import build_parser

    out: dict[str, Any] = {}
    for action in build_parser(["agent"]).subcommand("agent")._actions:
        name = next((o[2:] for o in action.option_strings if o.startswith("--")), None)
        if name is None or name in NOT_SETTINGS or action.help == argparse.SUPPRESS:
            continue
        out[name] = getattr(ns, action.dest, None)
    out["state-dir"] = os.path.abspath(state_dir)
    return out


def rereader(parser: Any, argv: list[str],
             state_dir: Callable[[argparse.Namespace], str]) -> Callable[[], dict[str, Any]]:
    """What SIGHUP reloads: the same command line parsed again and the settings file read
    again, as ``settings``; a ``CliError`` says what is wrong with the file. ``state_dir``:
    main.py's, passed in (main.py imports this module: no import back)."""
    def reread() -> dict[str, Any]:
        fresh = parser.parse(argv)
        apply(parser.subcommand("agent"), fresh, argv)
        return settings(fresh, state_dir(fresh))
    return reread


def convert(path: str, key: str, action: argparse.Action, value: Any) -> Any:
    where = f"agent: config file {path}: {key}"
    if action.nargs == 0:  # a flag: true or false
        if not isinstance(value, bool):
            raise CliError(f"{where}: expected true or false, got {value!r}")
        return action.const if value else action.default
    if isinstance(value, (dict, list, bool)):
        raise CliError(f"{where}: expected a {'number' if action.type else 'string'}, got "
                       f"{value!r}")
    text = str(value)
    try:
        result = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise CliError(f"{where}: {exc}") from None
    if action.choices is not None and result not in action.choices:
        raise CliError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return result


def client_state_dir() -> str | None:
    """The state dir the default settings file gives the agent, for clients on this node; any
    problem with the file is the agent's to report, not a client's."""
    try:
        with open(DEFAULT_PATH, "rb") as f:
            import tomllib

            value = tomllib.load(f).get("state-dir", None)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, str) and value else None
