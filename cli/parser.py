"""The argument tree of ``tether``: the parser, its errors, and ``build_parser``, which puts
every verb's options together (they are in ``options_jobs.py`` and ``options_node.py``, one
``add_<verb>`` function per verb so that options added later land in separate hunks).

Built on every run (of the verb named only, ``build_parser(argv)``), so it imports nothing
beyond argparse and the converters: each verb's own imports happen only when that verb runs
(``main.VERBS``). ``allow_abbrev=False`` everywhere: an option
prefix is an error, never silently another option (``--state`` is not ``--state-dir``), so that
adding an option can never change what an existing command line means.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from tether.cli.errors import EXIT_USAGE, CliError
from tether.cli.verbs import STATE_DIR_HELP

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    from typing import Any, NoReturn

EXIT_CODES = """exit codes:
  0    success
  1    an error: no agent answering, unknown job, request refused (one line on stderr)
  2    bad usage
  124  wait --timeout ran out
  130  interrupted (Ctrl-C)
  141  whoever read the output went away (tether list | head), as a SIGPIPE death
  wait and submit --wait exit with the job's own exit code, 128+N if signal N killed it"""


def _columns() -> int:
    """``shutil.get_terminal_size().columns``, without importing shutil (bz2, lzma, fnmatch:
    ~1.5 ms of every run, for argparse's formatter, which every ``add_argument`` creates)."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns or 80  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 80
    return columns


class Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        super().__init__(prog, indent_increment, max_help_position,
                         _columns() - 2 if width is None else width)  # as argparse's own


class Parser(argparse.ArgumentParser):
    """Errors as one CliError line (with a suggestion for a near miss); never abbreviations."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{self.prog}: {self.explain(message)}", EXIT_USAGE)

    def explain(self, message: str) -> str:
        """argparse's message, with a suggestion when the mistake is close to a real name."""
        m = re.match(r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if m:
            what, given = m.group(1), m.group(2)
            choices = re.findall(r"'([^']*)'", m.group(3))
            hint = suggest(given, choices)
            if what == "COMMAND":
                return f"'{given}' is not a command{hint} ('{self.prog} --help' lists them)"
            return f"argument {what}: invalid choice '{given}'{hint} (choose from " \
                   f"{', '.join(choices)})"
        return message

    def parse(self, args: list[str]) -> argparse.Namespace:
        """As parse_args, but an unknown option is reported by the subcommand it was given to,
        with a suggestion from that subcommand's own options."""
        ns, extras = self.parse_known_args(args)
        if extras:
            owner = self
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction) and getattr(ns, "cmd", None):
                    owner = action.choices[ns.cmd]
            hint = ""
            if extras[0].startswith("--"):
                names = [o for a in owner._actions for o in a.option_strings]
                hint = suggest(extras[0].partition("=")[0], names)
            owner.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return ns

    def subcommand(self, name: str) -> Parser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub: Parser = action.choices[name]
                return sub
        raise KeyError(name)


#: what people type for an option tether names otherwise (Slurm's words and common ones),
#: without the dashes: the first of the targets that the command has is suggested
MEANINGS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("memory", "ram", "mem-per-node", "memory-per-node", "mem-mb"),
                    ("mem", "memory-mb")),
    **dict.fromkeys(("cpu", "ncpus", "cores", "cpus-per-tasks", "threads"), ("cpus",)),
    **dict.fromkeys(("tasks", "np", "nprocs", "procs", "ranks", "ntask"), ("ntasks",)),
    **dict.fromkeys(("jobname", "job", "title"), ("job-name", "name")),
    **dict.fromkeys(("walltime", "wall", "timelimit", "time-limit", "limit", "runtime"),
                    ("time", "timeout")),
    **dict.fromkeys(("cwd", "dir", "workingdir", "working-dir", "wd", "directory",
                     "work-dir"), ("chdir", "workdir")),
    **dict.fromkeys(("gpu", "gres", "gpus-per-node", "gpus-per-job"), ("gpus",)),
    **dict.fromkeys(("stdout", "out", "log"), ("output",)),
    **dict.fromkeys(("stderr", "err"), ("error",)),
    **dict.fromkeys(("depend", "depends", "after", "deps"), ("dependency",)),
    **dict.fromkeys(("environment", "setenv", "var"), ("env",)),
}


def suggest(given: str, names: list[str]) -> str:
    """``; did you mean 'NAME'?`` for the name nearest ``given``, or "". By meaning first (the
    table above: ``--memory`` is ``--mem``), then by spelling: a name that ``given`` begins
    (``--cpu``: ``--cpus``, the shortest) or that begins ``given`` up to a dash
    (``--mem-per-node``: ``--mem``), then difflib's closest, all compared without the dashes
    (with them, ``--mem`` was nearer ``--time`` than ``--memory-mb``)."""
    bare = {name.lstrip("-").lower(): name for name in sorted(set(names), key=len)}
    key = given.lstrip("-").lower()
    hint = bare.get(key) or next((bare[t] for t in MEANINGS.get(key, ()) if t in bare), None)
    if hint is None and len(key) >= 2:
        longer = [n for n in bare if n.startswith(key) and n != key]
        shorter = [n for n in bare if key.startswith(n + "-")]
        found = longer[:1] or shorter[-1:]
        hint = bare[found[0]] if found else None
    if hint is None:
        import difflib  # only for a mistake

        close = difflib.get_close_matches(key, list(bare), n=1, cutoff=0.6)
        hint = bare[close[0]] if close else None
    return f"; did you mean '{hint}'?" if hint is not None else ""


def verb_of(argv: list[str]) -> str | None:
    """The command ``argv`` names (the first word after the global options), or None."""
    args = iter(argv)
    for arg in args:
        if arg == "--state-dir":
            next(args, None)
        elif arg.startswith("--state-dir="):
            continue
        elif arg.startswith("-"):
            return None  # --help, --version, a mistake: the whole parser answers
        else:
            return arg
    return None


def build_parser(argv: list[str] | None = None) -> Parser:
    """Every command's parser; or, given the command line, only the parser of the command it
    names (each one costs its imports and its argparse set-up on every run)."""
    from tether import __version__
    from tether.cli.options_jobs import (
        add_acct,
        add_attach,
        add_cancel,
        add_hold,
        add_inspect,
        add_list,
        add_release,
        add_resume,
        add_show,
        add_signal,
        add_submit,
        add_suspend,
        add_wait,
    )
    from tether.cli.options_node import (
        add_agent,
        add_cluster,
        add_completion,
        add_drain,
        add_man,
        add_nodes,
        add_status,
        add_top,
        add_upgrade,
    )

    p = Parser(prog="tether",
               usage="tether [-V] [--state-dir DIR] COMMAND [OPTIONS] ...",
               description="Run jobs on this node, each step under its own long-lived supervisor.",
               epilog=EXIT_CODES + "\n\n'tether COMMAND --help' describes each command.")
    p.add_argument("-V", "--version", action="version", version=f"tether {__version__}",
                   help="print the version and exit")
    p.add_argument("--state-dir", metavar="DIR", help=STATE_DIR_HELP)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=Parser, title="commands")
    adders = (add_agent, add_status, add_submit, add_list, add_show, add_wait, add_cancel,
              add_hold, add_release, add_inspect, add_attach, add_signal, add_top, add_upgrade,
              add_completion, add_man, add_cluster, add_nodes, add_drain, add_suspend, add_resume,
              add_acct)
    name = verb_of(argv) if argv is not None else None
    one = [a for a in adders if name is not None and _VERB_OF_ADDER.get(
        a.__name__, a.__name__[4:].replace("_", "-")) == name]
    if one:
        one[0](sub)
        if name in sub.choices:
            return p
        return build_parser()  # an adder named unlike its verb: everything, to be sure
    for add in adders:
        add(sub)
    return p


#: adders whose verb is not their name after ``add_``
_VERB_OF_ADDER = {"add_upgrade": "upgrade-supervisors"}

