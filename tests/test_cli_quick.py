"""The CLI's fast paths give what the slow ones gave: the quick parser argparse's Namespace,
``jsonout`` json.dumps's text, ``printable`` the regular expression's escapes. Pure: no agent.

The quick parser (``cli/quick.py``) may decline any command line (argparse then answers, as it
always did); what it accepts must parse under argparse to the very same Namespace. A generated
corpus of command lines, common and odd, checks that, and that it accepts enough to matter.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import time
from typing import Any

import pytest

from tether.cli import quick
from tether.cli.errors import CliError
from tether.cli.jsonout import dumps
from tether.cli.parser import Parser, build_parser, verb_of
from tether.shared.text import printable

_parsers: dict[str | None, Parser] = {}
#: a --begin date within the year it may be (a month from now, local time)
#: values computed from the clock (now+1h, 2h ago): equal when within seconds of each other
CLOCKED = ("begin", "since")
SOON = time.strftime("%Y-%m-%d", time.localtime(time.time() + 30 * 86400))


def argparse_vars(argv: list[str]) -> dict[str, Any] | None:
    """What main's argparse path makes of ``argv`` (the parser of the verb it names), or None
    where argparse refuses it or exits (help, version)."""
    name = verb_of(argv)
    if name not in _parsers:
        _parsers[name] = build_parser(argv)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return vars(_parsers[name].parse(argv))
        except (CliError, SystemExit):
            return None


def check(argv: list[str]) -> bool:
    """The quick parser declines ``argv`` or agrees with argparse; True if it accepted it."""
    got = quick.parse(argv)
    if got is None:
        return False
    want = argparse_vars(argv)
    assert want is not None, f"quick accepted what argparse refuses: {argv}"
    have = vars(got)
    for key in CLOCKED:  # read the clock: each parser at its own instant
        if isinstance(have.get(key), float) and isinstance(want.get(key), float) \
                and abs(have[key] - want[key]) < 5:
            have = dict(have, **{key: want[key]})
    assert have == want, f"{argv}:\n quick    {have}\n argparse {want}"
    assert list(vars(got)) == list(want), f"{argv}: the keys in another order"
    return True


# ---- hand-picked -----------------------------------------------------------------------------

ACCEPTED = [
    ["status"], ["status", "--json"], ["--state-dir", "/s", "status"], ["--state-dir=/s", "status"],
    ["inspect", "12", "--json"], ["inspect", "--json", "12"], ["inspect", "12_3", "--pids"],
    ["inspect", "7", "--output", "--lines", "5"], ["inspect", "7", "--lines=0", "--output"],
    ["inspect", "7", "--pids", "--pids"], ["--state-dir", "a", "inspect", "1", "--state-dir", "b"],
    ["show", "5"], ["show", "5_007", "--json"], ["wait", "3", "--timeout", "2.5"],
    ["wait", "--timeout=0", "3"], ["cancel", "1", "2", "3_4"], ["hold", "9"],
    ["release", "9", "10"],
    ["cancel", "--state-dir", "x", "1", "2"], ["cancel", "1", "2", "--state-dir", "x"],
    ["submit", "--", "true"], ["submit", "true"], ["submit", "--wait", "--", "sh", "-c", "exit 3"],
    ["submit", "--cpus", "2", "--ntasks=4", "--pmi", "pmi2", "--", "./mpi"],
    ["submit", "--env", "A=1", "--env", "_B=x=y", "--name", "n", "--json", "prog", "--cpus", "9"],
    ["submit", "--time", "1-02:03", "--array", "0-9%2", "--dependency", "afterok:4:5_1", "--", "x"],
    ["submit", "--begin", f"{SOON}T04:05", "--hold", "--no-requeue", "--", "x"],
    ["submit", "--name", "", "--workdir", "/tmp", "--user", "nobody", "--output", "o", "x"],
    ["submit", "--wait"], ["submit", "--", "--"], ["submit", "--cpus", "+2", "x"],
    ["list"], ["list", "--json"], ["list", "--state", "r,PD", "--user=a,b", "--name", "x"],
    ["list", "--since", "2h", "--format", "id,name:30", "--no-header", "--state-dir", "s"],
    ["list", "--since=2026-01-02"], ["submit", "--begin", "now+1h", "x"],
    # Slurm's spellings (issue 28): short options, aliases, --mem, --export, --ntasks-per-node
    ["submit", "-n", "4", "-c", "2", "-J", "sim", "-o", "o-%j", "-e", "e", "-t", "1:00", "x"],
    ["submit", "-D", "/tmp", "--chdir=/", "--job-name", "j", "--cpus-per-task", "3", "x"],
    ["submit", "--mem", "4G", "x"], ["submit", "--mem=512m", "--memory-mb", "7", "x"],
    ["submit", "--memory-mb", "7", "--mem", "1T", "--", "x"], ["submit", "-n=4", "x"],
    ["submit", "--ntasks-per-node", "2", "x"], ["submit", "--export", "NONE", "x"],
    ["submit", "--export=ALL,A=1,B", "--env", "C=3", "x"], ["submit", "-G", "1", "-H", "-W"],
    ["submit", "-a", "0-3%1", "-d", "afterany:1", "-b", "now", "x"],
]

DECLINED = [
    [], ["--help"], ["-V"], ["--version"], ["--state-dir", "x"], ["--cluster", "d", "status"],
    ["status", "-h"], ["status", "--help"], ["status", "--cluster", "d"], ["status", "x"],
    ["status", "--json=1"], ["inspect"], ["inspect", "1", "2"],
    ["inspect", "1", "--pids", "--stats"],
    ["inspect", " 1"], ["inspect", "01"], ["inspect", "0"], ["inspect", "1_"], ["inspect", "-1"],
    ["inspect", "١"], ["inspect", "1", "--lines", "-1"], ["inspect", "1", "--lines"],
    ["inspect", "--", "1"], ["inspect", "1", "--jso"], ["show", "1234567890123456789"],
    ["show", "1_12345678"], ["wait", "1", "--timeout", "x"], ["cancel"], ["cancel", "--name", "x"],
    ["cancel", "1", "--state-dir", "d", "2"], ["top"], ["agent"], ["inspec", "1"],
    ["list", "1"], ["list", "--state", "sleeping"], ["list", "--name", ","],
    ["list", "--since", "yesterday"], ["list", "--format"], ["list", "--no-header=1"],
    ["submit", "--name", "-x", "--", "true"], ["submit", "--cpus", "0", "x"],
    ["submit", "--pmi", "pmi3", "x"], ["submit", "--env", "1A=2", "x"], ["submit", "-x"],
    ["submit", "--time", "soon", "x"], ["submit", "--cluster", "d", "x"], ["submit", "--wait=1"],
    ["submit", "-5", "x"], ["submit", "--cpus"], ["--state-dir", "-x", "status"],
    ["submit", "-n4", "x"], ["submit", "-Jname", "x"], ["submit", "-HW", "x"],
    ["submit", "-H=1", "x"], ["submit", "--mem", "0", "x"], ["submit", "--mem", "4GB", "x"],
    ["submit", "--export", "ALL,NONE", "x"], ["submit", "--export", "A=1,2", "x"],
    ["submit", "-n", "-1", "x"], ["submit", "-N", "2", "x"], ["submit", "--nodes", "1", "x"],
]


@pytest.mark.parametrize("argv", ACCEPTED, ids=" ".join)
def test_the_common_forms_are_taken_and_parse_as_argparse_does(argv: list[str]) -> None:
    assert check(argv), f"declined: {argv}"


@pytest.mark.parametrize("argv", DECLINED, ids=lambda a: " ".join(a) or "(none)")
def test_help_errors_and_odd_forms_are_left_to_argparse(argv: list[str]) -> None:
    assert quick.parse(argv) is None


def test_each_verb_s_defaults_are_argparse_s() -> None:
    """A new option added to the parser and not to the quick table fails here (the quick
    Namespace would lack it)."""
    for name, verb in quick.VERBS.items():
        argv = {quick.JOB: [name, "1"], quick.JOBS: [name, "1"],
                quick.COMMAND: [name, "--", "x"]}.get(verb.positional or "", [name])
        assert check(argv), argv


# ---- a generated corpus ----------------------------------------------------------------------

REFS = ["1", "42", "999999999999999999", "3_0", "3_9999999", "3_007", "0", "01", "1_", "_1",
        "1__2", " 1", "1 ", "1_12345678", "1234567890123456789", "١٢", "x", "-1", "", "1.5"]
COMMON = ["--state-dir", "--state-dir=d", "--state-dir=", "--state-dir=-q", "d", "-", "--", "-h",
          "--help", "--cluster", "--cluster=d", "-V", "--json", "--json=", "x y", "-x y", "--st"]
OPTIONS: dict[str, list[str]] = {
    "status": ["--json"],
    "show": ["--json"],
    "wait": ["--timeout", "--timeout=3", "1.5", "-2", "inf", "nan", "x"],
    "inspect": ["--pmi", "--pids", "--stats", "--output", "--events", "--lines", "--lines=3",
                "--lines=-1", "10", "-1", "+3", "--json", "--pid", "--output=1"],
    "cancel": ["--state", "running", "--user", "--name", "n"],
    "hold": [], "release": [],
    "list": ["--state", "running", "r,pd", "bogus", "--user", "a,b", "--name", ",", "--since",
             "5m", "2026-01-02T03:04", "2026-13-01", "--format", "id:4,state", "--no-header",
             "--json", "--state=s"],
    "submit": ["--cpus", "--cpus=2", "2", "0", "--gpus", "--memory-mb", "--ntasks", "--name",
               "--name=", "--output", "--error", "--workdir", "--env", "A=1", "B=", "=1", "a b=c",
               "--env=C=3", "--user", "--pmi", "pmi1", "none", "--time", "5", "1-0", "0:30",
               "--array", "1-3", "1,2%1", "--dependency", "afterany:2", "afterok:x", "--begin",
               SOON, "2030-01-02", "--hold", "--wait", "--no-requeue", "--json", "true", "sh", "-c",
               "--cpu", "--wait=x", "٣", "-n", "-c", "-J", "-o", "-e", "-t", "-D", "-G", "-H",
               "-W", "-a", "-d", "-b", "-n2", "-n=2", "--mem", "--mem=2G", "4G", "0", "7k",
               "--ntasks-per-node", "--job-name", "--chdir", "--cpus-per-task", "--export",
               "ALL", "NONE", "A,B=1", "ALL,NONE", "-N"],
}


def generate(rng: random.Random) -> list[str]:
    """A well-formed command line (a third), one with a token changed, inserted or dropped (a
    third), or tokens drawn at random after a verb."""
    verb = rng.choice([*quick.VERBS, "top", "signal", "inspectx"])
    argv = well_formed(rng, verb) if verb in quick.VERBS else [verb]
    shape = rng.randrange(3)
    if shape == 1:
        pool = OPTIONS.get(verb, []) + REFS + COMMON
        at = rng.randrange(len(argv) + 1)
        change = rng.randrange(3)
        if change == 0 and at < len(argv):
            argv[at] = rng.choice(pool)
        elif change == 1:
            argv.insert(at, rng.choice(pool))
        elif at < len(argv):
            del argv[at]
    elif shape == 2:
        pool = OPTIONS.get(verb, []) + REFS + COMMON
        argv = argv[:argv.index(verb) + 1] if verb in argv else [verb]
        argv += [rng.choice(pool) for _ in range(rng.randrange(6))]
    return argv


def well_formed(rng: random.Random, verb: str) -> list[str]:
    """Global options, the verb, then its options and positionals in a random order."""
    argv: list[str] = []
    for _ in range(rng.choice([0, 0, 1, 2])):
        argv += rng.choice([["--state-dir", "g"], ["--state-dir=g"]])
    argv.append(verb)
    forms = [["--state-dir", "s"], ["--state-dir=s2"]]
    if verb in ("status", "show", "inspect", "list"):
        forms.append(["--json"])
    if verb == "list":
        forms += [["--state", rng.choice(["running", "PD,r", "active", "ended"])],
                  ["--user", "a,b"], ["--name=n"],
                  ["--since", rng.choice(["2h", "10", "2025-12-31", "2026-01-02T03:04:05"])],
                  ["--format", "id,name:20"], ["--no-header"]]
    if verb == "inspect":
        forms += [[rng.choice(["--pids", "--output", "--events", "--stats", "--pmi"])],
                  ["--lines", rng.choice(["4", "0", "+2"])], ["--lines=12"]]
    if verb == "wait":
        forms.append(["--timeout", rng.choice(["1", "0.5", "1e3"])])
    if verb == "submit":
        forms += [["--cpus", "3"], ["--env", "K=v"], ["--env=L=w"], ["--name", "a"], ["--wait"],
                  ["--time", rng.choice(["10", "1:00", "2-3"])], ["--pmi", "pmi1"],
                  ["--hold"], ["--json"], ["--gpus=0"], ["--begin", SOON], ["--user", "u"],
                  ["--array", "0-3%2"], ["--dependency", "afterany:3"], ["--no-requeue"],
                  ["-n", "2"], ["-c=2"], ["-J", "j"], ["-t", "5"], ["-D", "/"], ["--mem", "1G"],
                  ["--ntasks-per-node", rng.choice(["1", "2"])], ["--job-name=k"],
                  ["--export", rng.choice(["ALL", "NONE", "ALL,K=1", "K,L"])], ["-H"], ["-W"],
                  ["--chdir", "/tmp"], ["--cpus-per-task", "2"], ["-o", "o"], ["-e", "e"]]
    opts = [o for f in rng.sample(forms, rng.randrange(min(4, len(forms)) + 1)) for o in f]
    positional = quick.VERBS[verb].positional
    if positional == quick.COMMAND:
        return argv + opts + rng.choice([["--", "x", "-y"], ["x", "--cpus", "2"], ["--"], []])
    refs = [rng.choice(["1", "42", "3_0", "3_07"]) for _ in range(
        1 if positional == quick.JOB else rng.randrange(1, 4) if positional else 0)]
    at = rng.randrange(len(opts) + 1)
    while at and opts[at - 1].startswith("-") and "=" not in opts[at - 1] and opts[at - 1] \
            not in ("--json", "--pids", "--output", "--events", "--stats", "--pmi"):
        at -= 1  # not between an option and its value
    return argv + opts[:at] + refs + opts[at:]


def test_a_generated_corpus_parses_as_argparse_does() -> None:
    rng = random.Random(10)
    accepted: dict[str, int] = {}
    declined = 0
    for _ in range(30000):
        argv = generate(rng)
        if check(argv):
            verb = argv[next(i for i, a in enumerate(argv) if a in quick.VERBS)]
            accepted[verb] = accepted.get(verb, 0) + 1
        else:
            declined += 1
    # not vacuous: every verb's forms are taken often, and odd ones declined
    assert set(accepted) == set(quick.VERBS), accepted
    assert min(accepted.values()) >= 1000, accepted
    assert declined >= 8000, declined


# ---- json and escapes --------------------------------------------------------------------------

def test_jsonout_writes_what_json_dumps_writes() -> None:
    rng = random.Random(3)
    chars = ["a", "é", "\u2028", "\x00", "\n", '"', "\\", "\ud800", "😀", "\x7f", "/", "\t"]

    def value(depth: int) -> Any:
        kind = rng.randrange(9 if depth < 4 else 6)
        if kind == 0:
            return rng.choice([None, True, False])
        if kind == 1:
            return rng.choice([0, -1, 2**70, -(2**65), 7])
        if kind == 2:
            return rng.choice([0.0, -0.0, 1.5, 1e300, 1e-300, 0.1, float("nan"), float("inf"),
                               -float("inf")])
        if kind in (3, 4, 5):
            return "".join(rng.choice(chars) for _ in range(rng.randrange(6)))
        if kind == 6:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        if kind == 7:
            return tuple(value(depth + 1) for _ in range(rng.randrange(3)))
        return {rng.choice(["k", "é", 1, -2, 2.5, True, False, None, "\x01", float("nan")]):
                value(depth + 1) for _ in range(rng.randrange(4))}
    for _ in range(20000):
        v = value(0)
        assert dumps(v) == json.dumps(v), v


@pytest.mark.parametrize("value", [b"bytes", {1j: 1}, {(1, 2): 3}, object(), {"a": {1, 2}}])
def test_jsonout_leaves_other_types_to_json_and_its_error(value: Any) -> None:
    try:
        want: str | type[BaseException] = json.dumps(value)
    except TypeError:
        want = TypeError
    if want is TypeError:
        with pytest.raises(TypeError):
            dumps(value)
    else:
        assert dumps(value) == want


def test_jsonout_of_subclasses_and_deep_nesting_is_json_s() -> None:
    class Text(str):
        pass

    class Number(int):
        def __repr__(self) -> str:
            return "not a number"

    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    for v in ({"a": Text("b")}, [Number(3)], {Number(4): 1}):
        assert dumps(v) == json.dumps(v)
    with pytest.raises(RecursionError):
        json.dumps(deep)
    with pytest.raises(RecursionError):
        dumps(deep)


def test_printable_escapes_what_the_expression_did() -> None:
    """``printable`` escaped with ``re.sub(r"[\\x00-\\x1f\\x7f-\\x9f]", ...)``; a translate
    table now: every code point gives what it gave, but for the invisible characters that
    reorder or hide text (bidirectional controls, zero-width space, separators...), escaped as
    ``\\uNNNN`` since issue 27."""
    control = re.compile(r"[\x00-\x1f\x7f-\x9f]")
    hidden = re.compile("[\u061c\u200b\u200e\u200f\u2028-\u202e\u2060-\u2064\u2066-\u2069"
                        "\ufeff\ufff9-\ufffb]")
    text = "".join(chr(c) for c in range(0x110000))
    want = hidden.sub(lambda m: f"\\u{ord(m.group()):04x}",
                      control.sub(lambda m: f"\\x{ord(m.group()):02x}", text))
    assert printable(text) == want
    assert printable(42) == "42"
    assert printable("rm \u202efdp.exe") == "rm \\u202efdp.exe"
