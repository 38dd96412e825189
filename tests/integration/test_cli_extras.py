"""Shell completion, the man page and the agent's settings file (issue 13, friction 9: no shell
completion, no config file)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from tests.helpers import CLI, Node
from tether.cli.introspect import commands, every
from tether.cli.parser import build_parser


def out(*args: str) -> str:
    res = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.fixture(scope="module")
def bash_script() -> Iterator[str]:
    d = tempfile.mkdtemp(dir="/tmp", prefix="ttc")
    try:
        path = os.path.join(d, "tether.bash")
        with open(path, "w") as f:
            f.write(out("completion", "bash"))
        yield path
    finally:
        shutil.rmtree(d)


def complete(script: str, *words: str) -> list[str]:
    """What bash offers for the last of ``words`` (the word being typed)."""
    quoted = " ".join("'" + w + "'" for w in ("tether", *words))
    res = subprocess.run(
        ["bash", "--norc", "-c", f'source {script}; COMP_WORDS=({quoted}); '
         f'COMP_CWORD={len(words)}; COMPREPLY=(); _tether; printf "%s\\n" "${{COMPREPLY[@]}}"'],
        capture_output=True, text=True, timeout=30, cwd="/")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    return [w for w in res.stdout.split("\n") if w]


def test_bash_completes_commands_options_and_values(bash_script: str) -> None:
    assert complete(bash_script, "sub") == ["submit"]
    assert set(complete(bash_script, "")) >= {c.name for c in commands(build_parser())}
    assert complete(bash_script, "submit", "--pm") == ["--pmi"]
    assert complete(bash_script, "submit", "--pmi", "") == ["none", "pmi1", "pmi2"]
    # inspect's --pmi is a flag: nothing is offered as its value, its own options are
    assert complete(bash_script, "inspect", "3", "--pmi", "") == []
    assert "--stats" in complete(bash_script, "inspect", "3", "--")
    assert complete(bash_script, "completion", "") == ["bash", "zsh"]
    assert complete(bash_script, "list", "--state-dir", "tm") == ["tmp"]
    # past `--` the job's own command line is left to bash's defaults
    assert complete(bash_script, "submit", "--", "--pm") == []
    # a command's own commands (cluster's actions), their options and values
    assert complete(bash_script, "cluster", "") == ["init", "add-node", "node-down"]
    assert complete(bash_script, "cluster", "--state-dir", "/", "in") == ["init"]
    assert complete(bash_script, "cluster", "init", "--req") == ["--requeue"]
    assert complete(bash_script, "cluster", "init", "--requeue", "") == ["yes", "no"]
    assert complete(bash_script, "cluster", "node-down", "--con") == ["--confirm-dead"]


def test_zsh_script_parses_and_registers() -> None:
    if shutil.which("zsh") is None:
        pytest.fail("zsh is not installed (scripts/setup.sh --tests installs it)")
    d = tempfile.mkdtemp(dir="/tmp", prefix="ttz")
    try:
        path = os.path.join(d, "_tether")
        with open(path, "w") as f:
            f.write(out("completion", "zsh"))
        assert subprocess.run(["zsh", "-n", path], timeout=30).returncode == 0
        res = subprocess.run(["zsh", "-f", "-c", f"autoload -U compinit; compinit -u -D; "
                              f"source {path}; print -r -- $_comps[tether]"],
                             capture_output=True, text=True, timeout=30, env={"HOME": d})
        assert res.stdout.strip() == "_tether", res.stderr
    finally:
        shutil.rmtree(d)


def test_man_page_renders_cleanly_and_names_every_option() -> None:
    page = out("man")
    assert page.startswith(".TH TETHER 1")
    d = tempfile.mkdtemp(dir="/tmp", prefix="ttm")
    try:
        path = os.path.join(d, "tether.1")
        with open(path, "w") as f:
            f.write(page)
        res = subprocess.run(["groff", "-man", "-ww", "-z", path], capture_output=True,
                             text=True, timeout=30)
        assert res.returncode == 0 and res.stderr == "", res.stderr
        text = " ".join(subprocess.run(["groff", "-man", "-Tascii", "-P", "-cbou", path],
                                       capture_output=True, text=True, timeout=30).stdout.split())
    finally:
        shutil.rmtree(d)
    for c in every(commands(build_parser())):  # cluster's actions too: `tether cluster init`
        assert f"tether {c.name}" in text
        for o in c.options:
            assert o.names[-1] in text.replace("- ", "-"), f"{c.name} {o.names[-1]} missing"


# ---- the agent's settings file --------------------------------------------------------------


def settings(node: Node, text: str, mode: int = 0o644) -> str:
    path = os.path.join(node.dir, "agent.toml")
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return path


def test_settings_file_sets_agent_options_and_flags_override_it() -> None:
    node = Node(cpus=2)
    try:
        path = settings(node, 'cpus = 3\nnode = "from-file"\nmemory_mb = 512\n'
                        'cancel-grace = 1.5\nlog-level = "WARNING"\n')
        node.args = ["--config", path, "--cpus", "2"]  # --cpus on the line wins
        node.start()
        st = node.status()
        assert st["node"] == "from-file"
        assert st["cpus"]["total"] == 2
        assert st["memory_mb"]["total"] == 512
    finally:
        node.cleanup()


@pytest.mark.parametrize("text, mode, fragment", [
    ("cpu = 3\n", 0o644, "unknown setting 'cpu'; did you mean 'cpus'?"),
    ('cpus = "many"\n', 0o644, "cpus: 'many' is not a whole number"),
    ("cpus = 0\n", 0o644, "cpus: must be at least 1"),
    ("cpus = [\n", 0o644, "agent.toml: "),
    ('log-level = "LOUD"\n', 0o644, "'LOUD' is not one of"),
    ("cancel-grace = true\n", 0o644, "expected a number"),
    ("cpus = 2\n", 0o664, "writable by no one else"),
])
def test_bad_settings_are_one_line_and_start_nothing(text: str, mode: int,
                                                     fragment: str) -> None:
    node = Node(cpus=2)
    try:
        path = settings(node, text, mode)
        res = subprocess.run([*CLI, "agent", "--state-dir", node.state, "--config", path],
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 1
        assert res.stderr.count("\n") == 1 and fragment in res.stderr, res.stderr
        assert not os.path.exists(node.state), "the agent started anyway"
    finally:
        node.cleanup()


def test_missing_settings_file_named_with_config_is_an_error() -> None:
    res = subprocess.run([*CLI, "agent", "--config", "/nonexistent/tether.toml"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 1 and "does not exist" in res.stderr


def test_man_page_synopsis_names_only_options_tether_has() -> None:
    """Its SYNOPSIS is written by hand (cli/manpage.py): it named a global `--cluster DSN`
    that tether never had (issue 26, point 7)."""
    page = out("man")
    synopsis = page.split(".SH SYNOPSIS", 1)[1].split(".SH ", 1)[0].replace("\\-", "-")
    named = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", re.sub(r"\\f[BIRP]", "", synopsis)))
    top = {o for a in build_parser()._actions for o in a.option_strings}
    assert named and named <= top, sorted(named - top)
