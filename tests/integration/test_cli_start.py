"""What a short ``tether`` command costs before and after its work, held by behaviour: which
modules the frequent verbs import (against a real agent and job, so every import on their way
has happened), how the process ends (``entry``: os._exit once its output is flushed, the normal
way whenever something may need it), and where the venv finds bytecode. Timings are in
``bench/`` (docs/cli.md, "Start-up")."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.helpers import Node

#: the console script's body, as a -c program: no runpy (``-m`` imports contextlib & co.)
ENTRY = "import sys; from tether.cli.main import entry; sys.exit(entry())"

#: imported by none of the hot verbs: each costs every run 0.2-3 ms (argparse with its ``re``,
#: ``enum``, ``gettext`` and ``collections``, and msgpack with its ``datetime``, they all import:
#: the command line has one parser and one codec, issue 26)
NEVER = {
    "json", "socket", "selectors", "signal",
    "pwd", "typing", "dataclasses", "inspect", "contextlib", "shutil", "difflib",
    "subprocess", "threading", "logging", "importlib.util", "zmq", "psycopg", "rich",
    "tether.cli.cluster", "tether.cli.table", "tether.cli.jobfilter",
    "tether.shared.jobopts", "tether.shared.zmq_client", "tether.shared.outpattern",
}

#: what some verbs do import: list its table and filters; the verbs that take a JOB its checks
#: (argparse converts it with ``argtypes.job_ref``)
ALLOWED = {"list": {"tether.cli.table", "tether.cli.jobfilter"},
           **dict.fromkeys(("inspect", "show", "wait", "hold"), {"tether.shared.jobopts"})}


@pytest.fixture(scope="module")
def busy() -> Iterator[tuple[Node, int, int]]:
    """One agent for the module: a running job and a completed one."""
    n = Node()
    try:
        n.start()
        done = n.submit("true")
        assert n.wait_end(done)["state"] == "completed"
        running = n.submit("sleep", "300")
        n.wait_state(running, ("running",))
        yield n, running, done
    finally:
        n.cleanup()


def imports_of(node: Node, argv: list[str], code: int = 0) -> set[str]:
    res = subprocess.run([sys.executable, "-X", "importtime", "-c", ENTRY, *argv],
                         capture_output=True, text=True, env=node.env, cwd=node.work, timeout=60)
    assert res.returncode == code, res.stderr[-2000:]
    return modules(res.stderr)


def modules(importtime: str) -> set[str]:
    """The modules ``-X importtime`` reported on stderr."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime.splitlines()
            if line.startswith("import time:") and "imported package" not in line}


@pytest.mark.parametrize("argv, step", [
    (["inspect", "RUN", "--json"], True), (["inspect", "RUN"], True),
    (["inspect", "RUN", "--pids", "--json"], True),
    (["submit", "--", "true"], False), (["submit", "--wait", "--", "true"], False),
    (["submit", "--json", "--cpus", "1", "--env", "A=1", "--", "true"], False),
    (["status"], False), (["status", "--json"], False), (["show", "DONE", "--json"], False),
    (["show", "DONE"], False), (["wait", "DONE"], False), (["hold", "DONE"], False),
    (["list"], False), (["list", "--json", "--state", "r,cd", "--user", "root"], False),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_the_hot_verbs_import_only_what_they_use(busy: tuple[Node, int, int], argv: list[str],
                                                 step: bool) -> None:
    node, running, done = busy
    argv = [{"RUN": str(running), "DONE": str(done)}.get(a, a) for a in argv]
    code = 1 if argv[0] == "hold" else 0  # an ended job cannot be held: the error path too
    got = imports_of(node, argv, code)
    never = NEVER - ALLOWED.get(argv[0], set())
    bad = sorted(m for m in got if m in never or m.startswith(("tether.agent",
                                                               "tether.supervisor")))
    if not step:  # only inspect, attach and signal talk to a supervisor
        bad += [m for m in ("tether.shared.step_client", "tether.shared.procid") if m in got]
    assert not bad, f"tether {' '.join(argv)} imported {bad}"
    assert "tether.cli.parser" in got and "msgpack" in got  # the test saw the whole way


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["completion", "bash"], 0), (["man"], 0),
                                        (["submit", "--bogus", "x"], 2)])
def test_what_sends_no_frame_imports_no_msgpack(busy: tuple[Node, int, int], argv: list[str],
                                                code: int) -> None:
    """protocol.py imports msgpack (~2-4 ms, with what it imports) at first use only."""
    got = imports_of(busy[0], argv, code)
    assert "tether.cli.parser" in got and "msgpack" not in got


def console_script() -> str:
    script = os.path.join(os.path.dirname(sys.executable), "tether")
    if not os.path.exists(script):
        pytest.fail(f"no console script {script}: run the tests with the .venv that "
                    "scripts/setup.sh --tests makes", pytrace=False)
    return script


def test_the_console_script_starts_without_site(busy: tuple[Node, int, int]) -> None:
    """pip's script runs ``site`` (Debian's sitecustomize too, which imports apport's crash
    hook); setup.sh writes one that starts ``python -IS`` (scripts/launcher.py)."""
    node, _, _ = busy
    script = console_script()
    with open(script) as f:
        assert f.readline().rstrip("\n").endswith(" -IS")
    # the script as its first line runs it, with -X importtime in between
    res = subprocess.run([sys.executable, "-IS", "-X", "importtime", script, "status"],
                         capture_output=True, text=True, env=node.env, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    got = modules(res.stderr)
    assert "tether.cli.main" in got and "msgpack" in got
    assert not got & {"site", "sitecustomize", "apport_python_hook"}, sorted(got)


def test_the_console_script_ignores_pythonpath(busy: tuple[Node, int, int],
                                               tmp_path: str) -> None:
    """-I: a ``tether`` package on PYTHONPATH is not what runs (the agent is started by the
    same script, as root)."""
    node, _, _ = busy
    script = console_script()
    fake = os.path.join(tmp_path, "tether")
    os.makedirs(os.path.join(fake, "cli"))
    marker = os.path.join(tmp_path, "imported")
    for name in ("__init__.py", "cli/__init__.py", "cli/main.py"):
        with open(os.path.join(fake, name), "w") as f:
            f.write(f"open({marker!r}, 'w').close()\n")
    res = subprocess.run([script, "status"], capture_output=True, text=True, timeout=60,
                         env=dict(node.env, PYTHONPATH=str(tmp_path)), cwd=str(tmp_path))
    assert res.returncode == 0 and "agent on node" in res.stdout, res.stderr[-2000:]
    assert not os.path.exists(marker)


def test_the_venv_finds_bytecode_where_it_imports_tether_from() -> None:
    """The strict editable install imports tether through the links in build/; bytecode is
    looked up beside those (setup.sh compiles them): without, every start compiles every module
    (PYTHONDONTWRITEBYTECODE is set on these machines)."""
    probe = ("import importlib.util as u, os, tether.cli.main, tether.shared.protocol as p\n"
             "for m in (tether.cli.main, p):\n"
             "    print(m.__file__, os.path.exists(u.cache_from_source(m.__file__)))")
    out = subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[1::2] == ["True", "True"], out
    assert importlib.util.find_spec("tether") is not None


# ---- how the process ends ----------------------------------------------------------------------

def run_entry(node: Node, argv: list[str], prologue: str = "",
              **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", prologue + ENTRY, *argv], text=True,
                          env=node.env, cwd=node.work, timeout=60, **kw)  # type: ignore[call-overload]


def test_output_to_a_file_is_complete_and_exit_codes_are_kept(busy: tuple[Node, int, int],
                                                              tmp_path: str) -> None:
    """os._exit skips the interpreter's final flush: entry flushes first. A file is fully
    buffered (nothing of it is written before the flush), the hard case."""
    node, running, done = busy
    out = os.path.join(str(tmp_path), "out")
    for argv, code in ((["inspect", str(running), "--json"], 0), (["status", "--json"], 0),
                       (["submit", "--wait", "--json", "--", "sh", "-c", "exit 7"], 7)):
        with open(out, "w") as f:
            res = run_entry(node, argv, stdout=f, stderr=subprocess.PIPE)
        assert res.returncode == code, res.stderr
        with open(out) as f:
            text = f.read()
        assert text.endswith("}\n") and json.loads(text.splitlines()[-1]), text
    err = os.path.join(str(tmp_path), "err")
    with open(err, "w") as f:
        res = run_entry(node, ["show", "987654"], stdout=subprocess.PIPE, stderr=f)
    assert res.returncode == 1
    with open(err) as f:
        assert f.read() == "tether: no job 987654\n"


@pytest.mark.parametrize("argv", [["inspect", "RUN", "--json"], ["submit", "--", "true"],
                                  ["show", "RUN"]])
def test_a_closed_stdout_is_still_141_and_silent(busy: tuple[Node, int, int],
                                                 argv: list[str]) -> None:
    node, running, _ = busy
    argv = [str(running) if a == "RUN" else a for a in argv]
    r, w = os.pipe()
    os.close(r)
    try:
        res = run_entry(node, argv, stdout=w, stderr=subprocess.PIPE)
    finally:
        os.close(w)
    assert (res.returncode, res.stderr) == (141, "")


def test_the_normal_way_when_something_needs_it(busy: tuple[Node, int, int]) -> None:
    """An atexit handler runs, a running thread is waited for: entry leaves them the normal
    exit (the CLI registers neither; a library or a plug-in might)."""
    node, _, _ = busy
    res = run_entry(node, ["status"], "import atexit; atexit.register(print, 'at exit')\n",
                    capture_output=True)
    assert res.returncode == 0 and res.stdout.endswith("at exit\n"), res
    thread = ("import threading, time\n"
              "threading.Thread(target=lambda: (time.sleep(0.3), print('joined'))).start()\n")
    res = run_entry(node, ["status", "--json"], thread, capture_output=True)
    assert res.returncode == 0 and res.stdout.endswith("joined\n"), res
