"""Every ``tether`` command line the docs quote parses with today's parser (issue 26, point 7).

README.md and docs/*.md show command lines people copy: in code blocks and in inline code.
Each one is taken out of its shell line (``tether list; tether show 1 --json``,
``source <(tether completion bash); tether man | man -l -``, a trailing ``# comment``, a
trailing ``&``) and handed to the argparse parser exactly as ``cli/main.py`` builds it for that
line (``build_parser(argv)``, then ``Parser.parse``), without running anything. A line that no
longer parses fails by its file, line number and text, with the parser's own one-line error.

The docs (docs/cli.md above all) also write synopses (``tether suspend JOB``,
``tether submit [--cpus N] ... -- CMD [ARG...]``): a span with ``[``, ``...``, an
alternative (``|``) or a capitalised placeholder is a synopsis, not a command line. Its
words are metasyntax, so it is not parsed; instead every option it names must be an option
of the command it names (the synopses are written by hand, beside the generated man page).
``tether hold`` alone in prose names the command: its verb must exist. A span that names an
option after its command without ``tether`` (``submit --no-requeue``) is checked the same way.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys

import pytest

from tether.cli.errors import CliError
from tether.cli.parser import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: shell words that end one command and may begin the next
SEPARATORS = {";", "&", "&&", "|", "||", "(", ")", "<(", "$(", ">", "<", ">>"}
#: a synopsis' words: `JOB`, `NODE`, `CMD`, `ARG`, `SIGNAL`, `F[:W]`, ... (a real command line
#: names none: its job is `1`, its node `n1`)
PLACEHOLDER = re.compile(r"(?<![\w%-])[A-Z][A-Z_]*(?!\w)")
#: the `tether` command, as people type it or as the venv holds it
TETHER = re.compile(r"^(?:\S*/)?tether$")
#: a line that may run it
MENTIONS = re.compile(r"(?:^|[\s;&|(])(?:\S*/)?tether(?:\s|$)")


def strip_comment(line: str) -> str:
    """The shell line without its ``# comment`` (a ``#`` that begins a word, outside quotes)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def commands(shell: str) -> list[list[str]]:
    """Each ``tether ...`` command of one shell line, as the argv after ``tether``."""
    lexer = shlex.shlex(strip_comment(shell), posix=True, punctuation_chars=";&|()<>$")
    lexer.whitespace_split = True
    lexer.commenters = ""
    words = list(lexer)
    found: list[list[str]] = []
    start = True  # at the beginning of a command
    current: list[str] | None = None
    for word in words:
        if word in SEPARATORS or set(word) <= set(";&|()<>$"):
            if current is not None:
                found.append(current)
            current, start = None, True
            continue
        if current is not None:
            current.append(word)
        elif start and TETHER.match(word):
            current = []
        start = False
    if current is not None:
        found.append(current)
    return found


def code_lines(path: str) -> list[tuple[int, str]]:
    """(line number, shell line) of every line of a code block: indented by four spaces after a
    blank line (README.md's style) or between ``` fences."""
    with open(path) as f:
        lines = f.read().splitlines()
    out: list[tuple[int, str]] = []
    fenced = indented = False
    for n, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            out.append((n, line))
            continue
        if line.startswith("    ") and (indented or n == 1 or not lines[n - 2].strip()):
            indented = True
            if not line.lstrip().startswith(("- ", "* ", "|")):
                out.append((n, line.strip()))
            continue
        indented = indented and not line.strip()
    return out


def inline_spans(path: str) -> list[tuple[int, str]]:
    """(line number, text) of every inline code span that begins with ``tether ``."""
    with open(path) as f:
        lines = f.read().splitlines()
    out: list[tuple[int, str]] = []
    for n, line in enumerate(lines, 1):
        if line.startswith("    "):
            continue  # a code block's line: code_lines has it
        for span in re.findall(r"`([^`]+)`", line):
            if re.match(r"(?:\S*/)?tether\s", span):
                # a table cell writes a pipe as `\|`
                out.append((n, span.replace("\\|", "|")))
    return out


def synopsis(text: str) -> bool:
    """A usage line with metasyntax, not a command line (docs/cli.md's tables)."""
    words = text.split()
    return ("[" in text or "..." in text or "|" in text.replace(" | ", " ")
            or (len(words) > 1 and "/" in words[1]) or "/--" in text
            or bool(PLACEHOLDER.search(text)))


def named(text: str) -> bool:
    """A synopsis, or a command named in prose (``tether hold``): not a command line."""
    words = text.split()
    return synopsis(text) or (len(words) == 2 and bool(re.match(r"[a-z]", words[1])))


def quoted(doc: str, synopses: bool) -> list[tuple[str, list[str]]]:
    """(where, argv) of every tether command line quoted in ``doc``; with ``synopses``, the
    synopses and bare command names are left out (``synopses_of`` has them)."""
    path = os.path.join(ROOT, doc)
    found: list[tuple[str, list[str]]] = []
    for n, text in code_lines(path) + inline_spans(path):
        if not MENTIONS.search(text) or (synopses and named(text)):
            continue  # a log line, a diagram, a table: no tether command in it
        for argv in commands(text):
            found.append((f"{doc}:{n}: {text}", argv))
    return found


def synopses_of(doc: str) -> list[tuple[str, list[str], list[str]]]:
    """(where, the command's words, the options it names) of every synopsis in ``doc``'s
    inline code and code blocks (``tether inspect/attach/signal JOB ...`` names three
    commands; a code line's first command only, up to its ``;``)."""
    path = os.path.join(ROOT, doc)
    found: list[tuple[str, list[str], list[str]]] = []
    spans = [(n, strip_comment(t).split("; ")[0]) for n, t in code_lines(path)]
    spans += inline_spans(path)
    for n, text in spans:
        if not (text.split() and TETHER.match(text.split()[0]) and named(text)):
            continue
        words = text.split()[1:]
        if not words or not re.match(r"[a-z]", words[0]):
            continue  # `tether COMMAND --help`, `tether VERSION`: about every command
        options = [m for w in words
                   for m in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", w)]
        for verb in words[0].split("/"):
            command = [verb]
            if verb == "cluster" and len(words) > 1:
                command.append(words[1])
            found.append((f"{doc}:{n}: {text}", command, options))
    return found


def verb_options(doc: str) -> list[tuple[str, list[str], list[str]]]:
    """(where, the command, the options) of every inline span that names a command's option
    without `tether` before it (``submit --no-requeue``, ``agent --max-running-per-user``)."""
    verbs = set(subcommands(build_parser()))
    with open(os.path.join(ROOT, doc)) as f:
        lines = f.read().splitlines()
    found: list[tuple[str, list[str], list[str]]] = []
    for n, line in enumerate(lines, 1):
        for span in re.findall(r"`([^`]+)`", line):
            words = span.replace("\\|", "|").split()
            if len(words) >= 2 and words[0] in verbs and words[1].startswith("-"):
                options = re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", span)
                found.append((f"{doc}:{n}: {span}", [words[0]], options))
    return found


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subs[0].choices) if subs else {}


def options_of(command: list[str]) -> set[str] | None:
    """Every option string of ``command`` (``["cluster", "init"]``), or None when the parser
    has no such command."""
    parser: argparse.ArgumentParser = build_parser()
    for word in command:
        choices = subcommands(parser)
        if word not in choices:
            return None
        parser = choices[word]
    return {o for a in parser._actions for o in a.option_strings}


def parse_error(argv: list[str]) -> str | None:
    """The parser's complaint about ``argv``, or None when it parses, built as cli/main.py
    builds it (only the named verb's parser when the line names one)."""
    try:
        parser = build_parser(argv)
        ns = parser.parse(argv)
    except CliError as exc:
        return str(exc)
    except SystemExit as exc:  # --help, --version: argparse's own exits
        return None if exc.code == 0 else f"exit {exc.code}"
    if ns.cmd is None:
        return "no command"
    return None


README = quoted("README.md", synopses=False)
#: docs/cli.md first: the contract of the command line
DOCS_MD = ["docs/cli.md"] + sorted(f"docs/{n}" for n in os.listdir(os.path.join(ROOT, "docs"))
                                   if n.endswith(".md") and n != "cli.md")
CLI_MD = [found for doc in DOCS_MD for found in quoted(doc, synopses=True)]
SYNOPSES = [found for doc in DOCS_MD for found in synopses_of(doc)]
SYNOPSES += [found for doc in ["README.md", *DOCS_MD] for found in verb_options(doc)]


def test_the_docs_quote_command_lines() -> None:
    """The extraction finds what is there (a test that finds nothing cannot fail)."""
    assert len(README) >= 40, README
    assert sum(w.startswith("docs/cli.md") for w, _ in CLI_MD) >= 8, CLI_MD
    assert sum(w.startswith("docs/cli.md") for w, _, _ in SYNOPSES) >= 30, SYNOPSES
    assert any(w.startswith("docs/cluster.md") for w, _ in CLI_MD), CLI_MD
    readme = {" ".join(argv) for _, argv in README}
    assert "completion bash" in readme and "man" in readme  # inside <( ) and before a pipe
    assert "agent" in readme  # .venv/bin/tether agent &


@pytest.mark.parametrize("where, argv", README, ids=[w.split(":")[1] for w, _ in README])
def test_every_command_line_of_the_readme_parses(where: str, argv: list[str]) -> None:
    error = parse_error(argv)
    assert error is None, f"{where}\n  tether {shlex.join(argv)}: {error}"


@pytest.mark.parametrize("where, argv", CLI_MD,
                         ids=[":".join(w.split(":")[:2]) for w, _ in CLI_MD])
def test_every_command_line_of_the_docs_parses(where: str, argv: list[str]) -> None:
    error = parse_error(argv)
    assert error is None, f"{where}\n  tether {shlex.join(argv)}: {error}"


@pytest.mark.parametrize("where, command, options", SYNOPSES,
                         ids=[f"{':'.join(w.split(':')[:2])}-{'-'.join(c)}"
                              for w, c, _ in SYNOPSES])
def test_every_synopsis_of_the_docs_names_real_options(where: str, command: list[str],
                                                     options: list[str]) -> None:
    known = options_of(command)
    assert known is not None, f"{where}\n  no command 'tether {' '.join(command)}'"
    unknown = [o for o in options if o not in known]
    assert not unknown, f"{where}\n  'tether {' '.join(command)}' has no {', '.join(unknown)}"


@pytest.mark.parametrize("shell, expected", [
    ("tether list; tether show 1 --json", [["list"], ["show", "1", "--json"]]),
    ("source <(tether completion bash); tether man | man -l -",
     [["completion", "bash"], ["man"]]),
    (".venv/bin/tether agent &   # as root: state in /var/lib/tether", [["agent"]]),
    ("tether submit -o 'a #b' -- ./x#y  # it's a comment", [["submit", "-o", "a #b", "--",
                                                            "./x#y"]]),
    ("systemctl reload tether-agent", []),
    ("man tether", []),
])
def test_command_lines_are_found_in_shell_lines(shell: str, expected: list[list[str]]) -> None:
    assert commands(shell) == expected


def test_a_line_that_does_not_parse_is_reported() -> None:
    assert parse_error(["submit", "--cpu", "2", "--", "x"]) is not None
    assert parse_error(["nonsense"]) is not None
    assert parse_error(["list", "--state", "running"]) is None


def python_examples() -> list[tuple[str, str]]:
    """(where, code) of every ```python block of README.md and docs/*.md."""
    found: list[tuple[str, str]] = []
    docs = ["README.md"] + [f"docs/{n}" for n in sorted(os.listdir(os.path.join(ROOT, "docs")))
                            if n.endswith(".md")]
    for doc in docs:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            found.append((f"{doc}:{text[:m.start()].count(chr(10)) + 1}", m.group(1)))
    return found


EXAMPLES = python_examples()


@pytest.mark.parametrize("where, code", EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_every_python_example_compiles_and_imports_what_tether_has(where: str,
                                                                    code: str) -> None:
    """docs/client.md's example imported `shared.step_client`, which an installation does not
    have (one import root: `tether.shared.step_client`). Imported as a user's script would, by
    the venv's interpreter in isolated mode from `/` (the tests' own path has the checkout's
    folders on it, where `shared` is importable)."""
    import ast

    tree = ast.parse(code, where)  # a SyntaxError names the line
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            lines.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            lines += [f"import {alias.name}" for alias in node.names]
    assert lines, f"{where}: an example that imports nothing"
    res = subprocess.run([sys.executable, "-I", "-c", "\n".join(lines)], cwd="/",
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"{where}: {res.stderr.strip().splitlines()[-1]}"


def test_there_are_python_examples() -> None:
    assert any("client.md" in w for w, _ in EXAMPLES), EXAMPLES
