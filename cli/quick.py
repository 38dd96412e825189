"""The frequent command lines, parsed without argparse.

Building the argparse tree and parsing with it costs every run ~5 ms (argparse, gettext's look-ups
for translations, ``re``, the converters), a fifth of what ``tether inspect JOB --json`` may
take. ``parse`` reads the common forms of the hot verbs itself and gives the very Namespace
argparse would (``tests/test_cli_quick.py`` compares the two over a large generated corpus); for
anything it is not sure of it returns None and ``parser.py`` answers, as it always did: help,
the version, every mistake (so each error message stays argparse's), ``--``
anywhere but before a command, an option value that starts with ``-``, an option this table
does not list.

What it takes, after any number of ``--state-dir DIR`` (or ``--state-dir=DIR``):
  status [--json]
  show JOB [--json]                    JOB: ID or ARRAY_INDEX, digits as argparse takes them
  wait JOB [--timeout SECONDS]
  inspect JOB [--pmi|--pids|--stats|--output|--events] [--lines N] [--json]
  cancel JOB...     hold JOB...     release JOB...
  list [--state S] [--user U] [--name N] [--since T] [--format F] [--no-header] [--json]
  submit [OPTIONS] [--] COMMAND...     every option of submit, under each of its names
                                       (Slurm's too: -n 4 or -n=4; not -n4: argparse's)
each verb with ``--state-dir`` too, options before and after the positionals as argparse
allows them. Values are converted by the same functions argparse calls (``argtypes``).
"""

from __future__ import annotations

from tether.cli import argtypes

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable
    from typing import Any

    #: an option: the dest, how it stores (FLAG, ONE, APPEND) and its converter
    Option = tuple[str, str, Callable[[str], Any]]

#: how an option stores: a flag (store_true), one converted value, or each value appended
FLAG, ONE, APPEND = "flag", "one", "append"
#: what a verb's positionals are: one JOB, one or more JOBs, or the command (REMAINDER)
JOB, JOBS, COMMAND = "job", "jobs", "command"


def _pmi(text: str) -> str:
    if text not in ("none", "pmi1", "pmi2"):
        raise ValueError(text)
    return text


def _runtime(text: str) -> str:
    if text not in ("crun", "runc"):
        raise ValueError(text)
    return text


def _text(text: str) -> str:
    return text


def _filter(name: str) -> Callable[[str], Any]:
    """A converter of ``jobfilter`` (list's filters), imported when a filter is given."""
    def convert(text: str) -> Any:
        from tether.cli import jobfilter

        return getattr(jobfilter, name)(text)
    return convert


class Verb:
    """One verb's table: its positionals, its options (``--name``: dest, how, converter) and
    the defaults argparse gives, in argparse's order."""

    __slots__ = ("positional", "options", "defaults", "exclusive")

    def __init__(self, positional: str | None,
                 options: dict[str, Option],
                 defaults: dict[str, Any], exclusive: tuple[str, ...] = ()) -> None:
        self.positional = positional
        self.options = {"--state-dir": ("state_dir", ONE, _text), **options}
        self.defaults = defaults
        #: dests of which at most one may be given (argparse's mutually exclusive group)
        self.exclusive = exclusive


_JSON: dict[str, Option] = {"--json": ("json", FLAG, _text)}

def _names(dest: str, how: str, convert: Callable[[str], Any], *names: str) -> dict[
        str, Option]:
    return {name: (dest, how, convert) for name in names}


#: submit's options under every name the parser gives them (Slurm's short ones included:
#: ``-n 4`` and ``-n=4`` as argparse reads them; ``-n4`` is declined, argparse answers)
_SUBMIT: dict[str, Option] = {
    **_names("cpus", ONE, argtypes.positive, "-c", "--cpus", "--cpus-per-task"),
    **_names("gpus", ONE, argtypes.non_negative, "-G", "--gpus"),
    "--memory-mb": ("memory_mb", ONE, argtypes.non_negative),
    "--mem": ("memory_mb", ONE, argtypes.mem_size),
    **_names("ntasks", ONE, argtypes.positive, "-n", "--ntasks"),
    "--ntasks-per-node": ("ntasks_per_node", ONE, argtypes.positive),
    **_names("name", ONE, _text, "-J", "--name", "--job-name"),
    **_names("output", ONE, _text, "-o", "--output"),
    **_names("error", ONE, _text, "-e", "--error"),
    **_names("workdir", ONE, _text, "-D", "--workdir", "--chdir"),
    "--export": ("export", ONE, argtypes.export_spec),
    "--env": ("env", APPEND, argtypes.env_pair), "--user": ("user", ONE, _text),
    "--pmi": ("pmi", ONE, _pmi),
    **_names("time_limit", ONE, argtypes.time_limit, "-t", "--time"),
    **_names("array", ONE, argtypes.array_spec, "-a", "--array"),
    **_names("dependency", ONE, argtypes.dependency, "-d", "--dependency"),
    **_names("begin", ONE, argtypes.begin_time, "-b", "--begin"),
    **_names("hold", FLAG, _text, "-H", "--hold"), **_names("wait", FLAG, _text, "-W", "--wait"),
    "--no-requeue": ("no_requeue", FLAG, _text),
    "--export-slurm-env": ("export_slurm_env", FLAG, _text),
    "--container": ("container", ONE, _text),
    "--container-mounts": ("container_mounts", ONE, _text),
    "--container-runtime": ("container_runtime", ONE, _runtime),
    "--container-remap-root": ("container_remap_root", FLAG, _text), **_JSON}

VERBS: dict[str, Verb] = {
    "status": Verb(None, _JSON, {"json": False}),
    "show": Verb(JOB, _JSON, {"job": None, "json": False}),
    "wait": Verb(JOB, {"--timeout": ("timeout", ONE, argtypes.seconds)},
                 {"job": None, "timeout": None}),
    "inspect": Verb(
        JOB, {"--pmi": ("pmi", FLAG, _text), "--pids": ("pids", FLAG, _text),
              "--stats": ("stats", FLAG, _text), "--output": ("output", FLAG, _text),
              "--events": ("events", FLAG, _text),
              "--lines": ("lines", ONE, argtypes.non_negative), **_JSON},
        {"job": None, "pmi": False, "pids": False, "stats": False, "output": False,
         "events": False, "lines": None, "json": False},
        exclusive=("pmi", "pids", "stats", "output", "events")),
    "cancel": Verb(JOBS, {}, {"jobs": None, "state": None, "user": None, "name": None}),
    "list": Verb(
        None, {"--state": ("state", ONE, _filter("state_list")),
               "--user": ("user", ONE, _filter("name_list")),
               "--name": ("name", ONE, _filter("name_list")),
               "--since": ("since", ONE, _filter("since")), "--format": ("format", ONE, _text),
               "--no-header": ("no_header", FLAG, _text), **_JSON},
        {"state": None, "user": None, "name": None, "since": None, "format": None,
         "no_header": False, "json": False}),
    "hold": Verb(JOBS, {}, {"jobs": None}),
    "release": Verb(JOBS, {}, {"jobs": None}),
    "submit": Verb(COMMAND, _SUBMIT, {
        "cpus": 1, "gpus": 0, "memory_mb": 0, "ntasks": None, "ntasks_per_node": None,
        "name": None, "output": None, "error": None, "workdir": None, "export": None,
        "env": None, "user": None, "pmi": "none", "time_limit": None, "array": None,
        "dependency": None, "begin": None, "hold": False, "wait": False,
        "export_slurm_env": False, "container": None, "container_mounts": None,
        "container_runtime": None, "container_remap_root": False, "no_requeue": False,
        "json": False, "command": None}),
}

_DIGITS = frozenset("0123456789")


def job_ref(text: str) -> str | None:
    """``argtypes.job_ref`` for plain ASCII ``ID`` and ``ID_INDEX`` (what argparse would make
    of them); None for anything else (spaces, other digits, bad forms: argparse decides)."""
    job, sep, index = text.partition("_")
    if not (0 < len(job) <= 18 and job[0] != "0" and _DIGITS.issuperset(job)):
        return None
    if not sep:
        return job
    if not (0 < len(index) <= 7 and _DIGITS.issuperset(index)):
        return None
    return f"{job}_{int(index)}"


def _value(argv: list[str], i: int, name: str) -> tuple[str, int] | None:
    """The value of the option at ``argv[i]`` (``NAME VALUE`` or ``NAME=VALUE``) and the index
    after it; None where argparse might read it otherwise (no value, one that starts with -)."""
    arg = argv[i]
    if arg == name:
        if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            return argv[i + 1], i + 2
        return None
    if arg.startswith(name + "="):
        return arg[len(name) + 1:], i + 1
    return None


def parse(argv: list[str]) -> argparse.Namespace | None:
    """argparse's Namespace for a command line of the forms above, or None: let argparse say."""
    ns: dict[str, Any] = {"state_dir": None}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):  # the global options: --state-dir only
        got = _value(argv, i, "--state-dir")
        if got is None:
            return None
        ns["state_dir"], i = got
    if i >= len(argv) or argv[i] not in VERBS:
        return None
    verb = VERBS[argv[i]]
    ns["cmd"] = argv[i]
    ns.update(verb.defaults)
    if not _verb_args(verb, argv, i + 1, ns):
        return None
    result: argparse.Namespace = Namespace(**ns)  # type: ignore[assignment]
    return result


class Namespace:
    """What the verbs use of ``argparse.Namespace`` (attributes, ``in``, ``vars``), without
    importing argparse."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)

    def __contains__(self, key: str) -> bool:
        return key in self.__dict__

    def __repr__(self) -> str:
        return f"Namespace({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


def _verb_args(verb: Verb, argv: list[str], i: int, ns: dict[str, Any]) -> bool:
    """Fill ``ns`` from ``argv[i:]``, the verb's own arguments; False to decline."""
    refs: list[str] = []
    refs_ended = False  # an option came after the JOBs: argparse takes no more of them
    chosen = set()  # of verb.exclusive
    for dest, how, _convert in verb.options.values():
        if how == APPEND:
            ns[dest] = []  # a list of its own, as argparse copies its default
    while i < len(argv):
        arg = argv[i]
        if verb.positional == COMMAND and (arg == "--" or not arg.startswith("-")):
            ns["command"] = argv[i:]  # argparse's REMAINDER: the rest as given, -- included
            return True
        if not arg.startswith("-"):
            ref = job_ref(arg)
            if ref is None or refs_ended or verb.positional is None \
                    or (verb.positional == JOB and refs):
                return False
            refs.append(ref)
            i += 1
            continue
        refs_ended = bool(refs)
        name = arg.partition("=")[0]
        if name not in verb.options:
            return False
        dest, how, convert = verb.options[name]
        if how == FLAG:
            if arg != name:  # --json=...
                return False
            value: Any = True
            i += 1
        else:
            got = _value(argv, i, name)
            if got is None:
                return False
            text, i = got
            try:
                value = convert(text)
            except Exception:  # argparse says what is wrong with it, in its words
                return False
        if dest in verb.exclusive:
            chosen.add(dest)
            if len(chosen) > 1:
                return False
        if how == APPEND:
            ns[dest].append(value)
        else:
            ns[dest] = value
    if verb.positional == COMMAND:
        ns["command"] = []
    elif verb.positional == JOB:
        if len(refs) != 1:
            return False
        ns["job"] = refs[0]
    elif verb.positional == JOBS:
        if not refs:
            return False
        ns["jobs"] = refs
    return True
