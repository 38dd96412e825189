"""Batch scripts as Slurm users write them: ``tether submit job.sh [ARG...]``.

Without ``--``, a first word that names a file (as given, relative to the current directory:
never looked up in PATH, as sbatch does) which is a script rather than a program is a batch
script: read here, as the user (the command line runs as her; the agent never opens a user's
path), and sent with the submission, so that the copy is what runs and an edit of the file after
``submit`` changes nothing (shared/batch.py says how it runs). An ELF executable, or a file with
a NUL byte in its first line, is a program and runs as a command, as with ``--``; so does a
first word that names no file.

Directives: the comment lines at the top of the script (after ``#!``, up to the first line that
is neither a comment nor blank, Slurm's rule) that begin ``#TETHER`` (any option of ``submit``)
or ``#SBATCH`` (the options tether shares with sbatch: ``SBATCH_NAMES``; any other is named in
one warning and ignored, with its value) apply before the command line's options, which win
(each directive line is checked on its own, and a bad one is an error naming its line).
"""

from __future__ import annotations

import os
import sys

from tether.cli.errors import EXIT_USAGE, CliError
from tether.shared import batch

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    import argparse

    from tether.cli.parser import Parser

#: sbatch's names of the options tether shares with it (docs/cli.md, "Slurm's options"): what an
#: ``#SBATCH`` line may give; scripts/doc_tables.py checks them against the Slurm table
SBATCH_NAMES = frozenset((
    "-n", "--ntasks", "--ntasks-per-node", "-c", "--cpus-per-task", "--mem", "-G", "--gpus",
    "-J", "--job-name", "-o", "--output", "-e", "--error", "-t", "--time", "-D", "--chdir",
    "--workdir", "--export", "-a", "--array", "-d", "--dependency", "-b", "--begin", "-H",
    "--hold", "-W", "--wait", "--no-requeue"))
#: what no directive may say (it would not be an option of the job)
_REFUSED = frozenset(("-h", "--help", "--state-dir"))


def load(path: str) -> bytes | None:
    """The script at ``path``, or None when ``path`` names no regular file the user can read,
    or a program: those run as commands. CliError for a script too long to send or written
    with DOS line breaks (it would fail at run time, as sbatch says)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO never blocks
    except OSError:
        return None
    try:
        import stat

        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        data = b""
        while len(data) <= batch.MAX_SCRIPT and (chunk := os.read(fd, 1 << 16)):
            data += chunk
    except OSError as exc:
        raise CliError(f"submit: cannot read the script {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if batch.looks_binary(data[:1024]):
        return None
    if len(data) > batch.MAX_SCRIPT:
        raise CliError(f"submit: the script {path} is longer than {batch.MAX_SCRIPT // 1024} KiB "
                       "(a batch script travels with the submission)", EXIT_USAGE)
    if not data:
        raise CliError(f"submit: the script {path} is empty", EXIT_USAGE)
    if b"\r\n" in data:
        raise CliError(f"submit: the script {path} has DOS line breaks (\\r\\n) instead of "
                       "Unix ones (\\n): convert it first (dos2unix)", EXIT_USAGE)
    return data


def directive_lines(script: bytes) -> list[tuple[int, str, str]]:
    """(line number, ``TETHER`` or ``SBATCH``, the rest of the line) of each directive."""
    out = []
    for number, raw in enumerate(script.split(b"\n"), 1):
        line = raw.decode("utf-8", "surrogateescape")
        if number == 1 and line.startswith("#!"):
            continue
        stripped = line.strip()
        if not stripped:
            continue
        if not stripped.startswith("#"):
            break  # the first command: no directive after it counts (Slurm's rule)
        for word in ("TETHER", "SBATCH"):
            head = "#" + word
            if line.startswith(head) and (len(line) == len(head) or line[len(head)] in " \t"):
                out.append((number, word, line[len(head):]))
    return out


def _words(path: str, number: int, text: str) -> list[str]:
    import shlex

    try:
        return shlex.split(text, comments=True)
    except ValueError as exc:
        raise CliError(f"submit: {path}, line {number}: {exc}", EXIT_USAGE) from None


def _sbatch(words: list[str], ignored: list[str]) -> list[str]:
    """The words of an ``#SBATCH`` line tether takes; the others' names go to ``ignored``
    (an ignored option's value, the next word when it is not an option, goes with it)."""
    takes_value = {name: a.nargs != 0 for a in _submit_parser().subcommand("submit")._actions
                   for name in a.option_strings}
    kept: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("--"):
            name, attached = word.partition("=")[0], "=" in word
        elif word.startswith("-") and len(word) > 1:
            name, attached = word[:2], len(word) > 2
        else:
            ignored.append(word)
            i += 1
            continue
        takes = takes_value.get(name, False)
        if name in SBATCH_NAMES:
            kept.append(word)
            if takes and not attached and i + 1 < len(words):
                kept.append(words[i + 1])
                i += 1
        else:
            ignored.append(name)
            if not attached and i + 1 < len(words) and not words[i + 1].startswith("-"):
                i += 1  # its value
        i += 1
    return kept


def _submit_parser() -> Parser:
    """``build_parser(["submit"])``, built once for all of a script's lines."""
    global _parser
    if _parser is None:
        from tether.cli.parser import build_parser

        _parser = build_parser(["submit"])
    return _parser


_parser: Parser | None = None


def parse(argv: list[str]) -> argparse.Namespace:
    """``argv`` (a ``submit`` command line) as ``tether`` reads it."""
    return _submit_parser().parse(argv)


def options(path: str, script: bytes) -> list[str]:
    """The directives' options, in order, each line checked; a warning names the ``#SBATCH``
    options tether ignores."""
    out: list[str] = []
    ignored: list[str] = []
    for number, word, text in directive_lines(script):
        words = _words(path, number, text)
        if word == "SBATCH":
            words = _sbatch(words, ignored)
        bad = [w for w in words if w.partition("=")[0] in _REFUSED]
        if bad:
            raise CliError(f"submit: {path}, line {number}: #{word} {bad[0]} is not an option "
                           "of a job", EXIT_USAGE)
        if not words:
            continue
        try:
            got = parse(["submit", *words, "--", "true"])
        except CliError as exc:
            why = str(exc).removeprefix("tether submit: ")
            raise CliError(f"submit: {path}, line {number}: #{word} {' '.join(words)}: {why}",
                           EXIT_USAGE) from None
        if list(got.command) != ["--", "true"]:
            raise CliError(f"submit: {path}, line {number}: #{word} takes options only, not "
                           f"{got.command[0]!r}", EXIT_USAGE)
        out += words
    if ignored:
        from tether.cli.format import say

        names = ", ".join(dict.fromkeys(ignored))
        say(f"tether: {path}: ignoring #SBATCH {names}: not options tether has "
            "(docs/slurm.md)", file=sys.stderr)
    return out


def verb_index(argv: list[str]) -> int:
    """Where the verb is in ``argv`` (after the global ``--state-dir``)."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 1 if argv[i].startswith("--state-dir=") else 2
    return i


def apply(ns: argparse.Namespace, path: str, script: bytes) -> argparse.Namespace:
    """``ns`` (a submit's, with its ``argv``) with the script's directives applied before the
    command line's own options, which win: both parsed together, directives first."""
    argv = list(ns.argv)
    verb = verb_index(argv)
    own = argv[verb + 1:len(argv) - len(ns.command)]  # the options between verb and script
    merged = parse(["submit", *options(path, script), *own, "--", "true"])
    merged.command = ns.command
    merged.argv = argv
    if merged.state_dir is None:  # given before the verb only
        merged.state_dir = ns.state_dir
    return merged
