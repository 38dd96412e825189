"""The supervisor's one loop: nothing slow runs on it (the scan for leftovers is a thread's),
and an error it does not expect ends the process (crash-only), the agent giving the verdict."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import prctl
import pytest

from tests import needs
from tests.helpers import Node, pid_alive, poll_until
from tether.shared.client import Client
from tether.shared.procid import ProcId, all_processes


def test_the_loop_answers_while_leftovers_are_looked_for(node: Node) -> None:
    # The scan of /proc for leftover children stops (test fault) once it has looked, until
    # sweep.go exists: the supervisor must answer meanwhile, and kill the leftover after.
    # Without cgroups: a step's cgroup would have the leftover killed before any scan.
    node.args += ["--cgroup", "none"]
    node.start(env={"TETHER_SUPERVISOR_FAULT": "hold-sweep"})
    # the daemon writes its pid once it has its own session: the task must not exit before
    # (its process group, which the supervisor kills when the task ends, held the daemon)
    job = node.submit("sh", "-c", "setsid sh -c 'echo $$ > daemon.pid; exec sleep 300' "
                                  "</dev/null >/dev/null 2>&1 & "
                                  "while [ ! -s daemon.pid ]; do sleep 0.01; done")
    rd = node.layout.run_dir(job, 1)
    poll_until(lambda: os.path.exists(os.path.join(rd.path, "sweep.held")), 30,
               "the scan for leftovers to be under way")
    with open(os.path.join(node.work, "daemon.pid")) as f:
        daemon = int(f.read())
    with Client(rd.sock, timeout=5) as c:
        state = c.call("state", {})
    assert state["phase"] == "draining"
    assert node.job(job)["state"] == "running"
    assert pid_alive(daemon), "the leftover was killed before its scan came back"
    open(os.path.join(rd.path, "sweep.go"), "w").close()
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0)
    poll_until(lambda: not pid_alive(daemon), 10, "the leftover daemon to be killed")


def test_the_loop_answers_while_a_stats_request_waits_for_its_scan(node: Node) -> None:
    # The /proc scan behind `stats` stops (test fault) until scan.go exists: `state` is
    # answered meanwhile, and `stats` once the scan is in.
    node.start(env={"TETHER_SUPERVISOR_FAULT": "hold-scan"})
    job = node.submit("sleep", "300")
    node.wait_state(job, ("running",))
    rd = node.layout.run_dir(job, 1)
    got: list[Any] = []

    def ask() -> None:
        with Client(rd.sock, timeout=30) as c:
            got.append(c.call("stats", {}))
    asker = threading.Thread(target=ask)
    asker.start()
    try:
        poll_until(lambda: os.path.exists(os.path.join(rd.path, "scan.held")), 30,
                   "the stats request's scan to be under way")
        with Client(rd.sock, timeout=5) as c:
            assert c.call("state", {})["phase"] == "running"
        assert got == [], "stats was answered before its scan came back"
    finally:
        open(os.path.join(rd.path, "scan.go"), "w").close()
        asker.join(60)
    assert got and got[0]["tasks"][0]["alive"] and got[0]["total"]["processes"] >= 1, got
    node.ok("cancel", str(job))
    assert node.wait_end(job)["state"] == "cancelled"


@pytest.fixture
def adopting() -> Iterator[None]:
    """This test process adopts orphans (a child subreaper) so that a supervisor's exit status
    reaches it; the test reaps what it adopted (``_reap_adopted``)."""
    prctl.set_child_subreaper(1)
    try:
        yield
    finally:
        prctl.set_child_subreaper(0)


def test_an_unexpected_error_in_the_loop_ends_the_supervisor_and_the_agent_judges(
        adopting: None, node: Node) -> None:
    try:
        # cold: a warm supervisor is the template's child until the template leaves (the
        # template reaps it), a cold one is re-parented to this subreaper, which sees its status
        node.start(env={"TETHER_SUPERVISOR_FAULT": "error-on-usr2",
                        "TETHER_AGENT_FAULT": "no-template"})
        job = node.submit("sh", "-c", "sleep 300 & sleep 300; wait", opts=("--cpus", "2"))
        node.wait_state(job, ("running",))
        man = node.running_manifest(job)
        sup = ProcId.from_dict(man["supervisor"])
        os.kill(sup.pid, signal.SIGUSR2)  # the fault raises RuntimeError in the loop

        def status() -> int | None:
            pid, st = os.waitpid(sup.pid, os.WNOHANG)  # ours: adopted when it detached
            return os.waitstatus_to_exitcode(st) if pid else None
        code = poll_until(lambda: (s := status()) is not None and [s], 30,
                          "the supervisor to exit")[0]
        assert code == 3, f"the supervisor exited with {code}, not 3 (cannot go on)"
        j = node.wait_state(job, ("lost",))
        assert j["reason"] and f"supervisor (pid {sup.pid}) died" in j["reason"]
        left = [st.pid for st in all_processes()
                if st.session == man["session"] and not st.dead and st.pid != sup.pid]
        assert left == [], f"the step's processes outlived their supervisor: {left}"
        assert node.status()["cpus"]["allocated"] == 0
        with open(node.layout.supervisor_log) as f:  # crash-only: the log says why (contract)
            assert "the supervisor cannot go on" in f.read()
    finally:
        node.cleanup()
        _reap_adopted()


def _reap_adopted() -> None:
    """Reap every orphan adopted meanwhile (the template, the step's killed processes); all
    were killed by ``cleanup``."""
    def reaped_all() -> bool:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return True
        return False
    poll_until(reaped_all, 20, "the adopted processes to be reaped")


def _backlog(path: str) -> int:
    """Connections waiting to be accepted on the listening AF_UNIX socket at ``path``."""
    out = subprocess.run(["ss", "-xlH", "src", path], capture_output=True, text=True,
                         check=True).stdout.split()
    return int(out[2]) if len(out) > 2 else 0


def test_the_agents_hello_before_zeromq_is_up_is_answered(node: Node) -> None:
    needs.tool("ss", "iproute2")
    # The ready byte goes out once both sockets listen, before the supervisor starts ZeroMQ
    # (held there by the fault): the agent connects at once and its connection waits in the
    # kernel's backlog, then is served.
    node.start(env={"TETHER_SUPERVISOR_FAULT": "hold-after-ready"})
    job = node.submit("sh", "-c", "echo ran > ran.txt")
    rd = node.layout.run_dir(job, 1)
    poll_until(lambda: os.path.exists(os.path.join(rd.path, "ready.held")), 30,
               "the supervisor to hold after its ready byte")
    poll_until(lambda: _backlog(rd.ctl_sock) >= 1, 30,
               "the agent's connection to wait in the backlog")
    assert node.job(job)["state"] == "starting"
    assert not os.path.exists(os.path.join(node.work, "ran.txt"))
    open(os.path.join(rd.path, "ready.go"), "w").close()
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"], j["attempt"]) == ("completed", 0, 1), j
