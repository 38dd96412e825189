"""docs/operations.md's "Upgrading with jobs running", followed as written (issue 28, point 7),
offline: release 0.5.0 (commit 3b5d4e1) installed in a venv and running jobs; then, step by
step, ``pip install .`` of this checkout into that same venv (a copy of the checkout with the
build/ and editable links a developer's has), the old agent still serving the new CLI and
starting new supervisors; SIGTERM and the new agent, which migrates the database (keeping
``tether.db.v<old schema>``), reattaches to the old release's running supervisors and collects
their true results (one after ``upgrade-supervisors`` re-executed it into this release: its ctl
door's listening socket taken over by this release's ROUTER); and each release's CLI against
the other's agent. The wheels come from the
tests' wheelhouse (tests/releases.py), so nothing is downloaded."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

import tether
from tests.helpers import Node, default_output, poll_until
from tests.integration.test_packaging import _checkout_with_stale_build, _tree
from tests.releases import ROOT, make_venv, pip_install, release
from tether.agent import schema

#: release 0.5.0, the last before issue 28's accounting and batch scripts (schema 7)
RELEASE_0_5_0 = "3b5d4e1"
OLD_SCHEMA = 7
#: a job that runs until its gate file appears, then exits with CODE
GATED = 'while [ ! -e "{gate}" ]; do sleep 0.05; done; exit {code}'


@pytest.fixture
def scratch() -> Iterator[str]:
    path = tempfile.mkdtemp(dir="/tmp", prefix="ttup")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def tether_in(node: Node, bindir: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([os.path.join(bindir, "tether"), *args], capture_output=True,
                          text=True, env=node.env, cwd=node.work, timeout=60)


def ok_in(node: Node, bindir: str, *args: str) -> str:
    res = tether_in(node, bindir, *args)
    assert res.returncode == 0 and "Traceback" not in res.stderr, \
        f"{bindir}/tether {' '.join(args)}: rc={res.returncode} {res.stderr}\n{node.logs()}"
    return res.stdout


def show(node: Node, bindir: str, job: int) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(ok_in(node, bindir, "show", str(job), "--json"))
    return result


def gated(node: Node, bindir: str, name: str, code: int) -> int:
    gate = os.path.join(node.work, name)
    return int(ok_in(node, bindir, "submit", "-J", name, "--", "sh", "-c",
                     GATED.format(gate=gate, code=code)).strip())


def open_gate(node: Node, name: str) -> None:
    open(os.path.join(node.work, name), "w").close()


def test_the_upgrade_steps_of_operations_md_as_written(make_node: Any, scratch: str) -> None:
    old_bin = release(RELEASE_0_5_0)  # 0.5.0's own CLI, for step 3 (a venv of its own)
    # the installation to upgrade: 0.5.0 in a venv, as a site would have it
    python = make_venv(os.path.join(scratch, "venv"))
    archive = os.path.join(scratch, "old")
    os.makedirs(archive)
    with subprocess.Popen(["git", "-C", ROOT, "archive", RELEASE_0_5_0],
                          stdout=subprocess.PIPE) as git:
        subprocess.run(["tar", "-x", "-C", archive], stdin=git.stdout, check=True)
    assert git.returncode == 0
    pip_install(python, archive)
    bindir = os.path.dirname(python)
    assert ok_in_plain(bindir, "--version") == "tether 0.5.0"

    node: Node = make_node(cpus=2)
    node.tether = [os.path.join(bindir, "tether")]
    node.start()
    assert node.status()["schema"] == OLD_SCHEMA
    ended = int(ok_in(node, bindir, "submit", "-J", "before", "--", "sh", "-c", "exit 4")
                .strip())
    running = gated(node, bindir, "running", 7)  # runs across the whole upgrade
    doomed = gated(node, bindir, "doomed", 0)  # cancelled by the new CLI
    assert node.wait_end(ended)["state"] == "failed"
    node.wait_state(running, ("running",))
    node.wait_state(doomed, ("running",))
    old_supervisor = show(node, bindir, running)["supervisor_pid"]

    # 1. Install the new release: pip install . of the new checkout; the checkout's build/
    # (and the editable install's links in it) is left as it was
    src = _checkout_with_stale_build(scratch)
    build_before = _tree(os.path.join(src, "build"))
    pip_install(python, src)
    assert _tree(os.path.join(src, "build")) == build_before
    assert ok_in_plain(bindir, "--version") == f"tether {tether.__version__}"
    # running supervisors never read the package again: the job runs on, unchanged
    assert show(node, bindir, running)["state"] == "running"
    # until the agent restarts, the old agent serves the new CLI and starts supervisors from
    # its warm template, which holds the old release in memory (docs/operations.md says so)
    ok_in(node, bindir, "cancel", str(doomed))
    assert node.wait_end(doomed)["state"] == "cancelled"
    during = int(ok_in(node, bindir, "submit", "-J", "during", "--", "sh", "-c",
                       "echo $TETHER_JOB_ID").strip())
    assert tether_in(node, bindir, "wait", str(during)).returncode == 0
    with open(default_output(node.work, during)) as f:
        assert f.read() == f"{during}\n"
    assert [j["id"] for j in json.loads(ok_in(node, bindir, "list", "--json"))] == [
        ended, running, doomed, during]
    assert json.loads(ok_in(node, bindir, "status", "--json"))["version"] == "0.5.0"
    with open(node.layout.supervisor_log) as f:
        log = f.read()
    assert f"job={during}.1 INFO ready on" in log and "(warm start)" in log.split(
        f"job={during}.1 INFO ready on")[1].splitlines()[0]
    assert "supervisor template 0.5.0+" in log

    # 2. Stop the agent (SIGTERM: jobs and supervisors keep running) and start the new one:
    # the database migrated in place after a copy, the old supervisor reattached
    assert node.stop(signal.SIGTERM) == 0
    assert show_pid_alive(old_supervisor)
    node.start()
    status = json.loads(ok_in(node, bindir, "status", "--json"))
    assert (status["version"], status["schema"]) == (tether.__version__, schema.SCHEMA_VERSION)
    assert os.path.exists(f"{node.layout.db}.v{OLD_SCHEMA}")
    j = show(node, bindir, running)
    assert (j["state"], j["supervisor_pid"]) == ("running", old_supervisor)
    inspected = json.loads(ok_in(node, bindir, "inspect", str(running), "--json"))
    assert inspected["state"] == "running"
    assert threads(old_supervisor) == 1  # 0.5.0's: a ctl door, no ZeroMQ
    # and in place (docs/operations.md, "Upgrading the supervisors in place"): the 0.5.0
    # supervisor re-executes into this release, whose ROUTER takes the ctl door's listening
    # socket over (libzmq's threads beside its loop now); the new agent's DEALER reconnects
    ok_in(node, bindir, "upgrade-supervisors", str(running))
    assert threads(old_supervisor) == 3
    j = show(node, bindir, running)
    assert (j["state"], j["supervisor_pid"]) == ("running", old_supervisor)
    open_gate(node, "running")
    assert tether_in(node, bindir, "wait", str(running)).returncode == 7  # its true result

    # 3. The CLI of either release works against the agent of the other (the new CLI against
    # the old agent in step 1): the old CLI against the new agent
    assert json.loads(ok_in(node, old_bin, "status", "--json"))["version"] == tether.__version__
    late = gated(node, old_bin, "late", 3)
    cancelled = gated(node, old_bin, "cancelled", 0)
    node.wait_state(late, ("running",))
    ok_in(node, old_bin, "cancel", str(cancelled))
    open_gate(node, "late")
    assert tether_in(node, old_bin, "wait", str(late)).returncode == 3
    assert show(node, old_bin, cancelled)["state"] == "cancelled"
    assert [j["id"] for j in json.loads(ok_in(node, old_bin, "list", "--json"))] == [
        ended, running, doomed, during, late, cancelled]

    # and what the new release adds works on the upgraded database: the accounting history
    # holds the jobs that ended before the upgrade too (without usage: nothing measured it)
    acct = {r["id"]: r for r in json.loads(ok_in(node, bindir, "acct", "--json"))}
    assert set(acct) == {ended, running, doomed, during, late, cancelled}
    assert (acct[ended]["name"], acct[ended]["exit_code"], acct[ended]["maxrss_kb"]) == (
        "before", 4, None)
    assert acct[running]["exit_code"] == 7
    assert acct[late]["maxrss_kb"] is not None  # a step the new release ran and measured


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln.split()[1] for ln in f if ln.startswith("Threads:")))


def ok_in_plain(bindir: str, *args: str) -> str:
    res = subprocess.run([os.path.join(bindir, "tether"), *args], capture_output=True,
                         text=True, cwd="/", timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def show_pid_alive(pid: int) -> bool:
    from tests.helpers import pid_alive

    return poll_until(lambda: pid_alive(pid), 5, f"supervisor {pid} to be alive")
