"""Crash windows and edge cases found in review: each test failed before its fix."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

from tests.helpers import Node, poll_until
from tether.shared.client import Client
from tether.shared.procid import ProcId, proc_stat


def test_supervisor_dying_while_launching_is_lost_not_rerun(node: Node) -> None:
    node.start(env={"TETHER_SUPERVISOR_FAULT": "die-after-launch"})
    job = node.submit("sh", "-c", "echo ran >> runs.txt; sleep 300")
    runs = os.path.join(node.work, "runs.txt")
    # the supervisor holds after the launch until the task has run (the fault's go): without,
    # the agent could kill the task before its first line, and nothing here would have run
    poll_until(lambda: os.path.exists(runs), 10, "the task to have run")
    with open(os.path.join(node.layout.run_dir(job, 1).path, "launched.go"), "w"):
        pass
    j = node.wait_state(job, ("lost",))
    assert j["attempt"] == 1, "a launch that may have run must never be retried"
    with open(runs) as f:
        assert f.read() == "ran\n"
    assert node.status()["cpus"]["allocated"] == 0
    out = subprocess.run(["pgrep", "-f", "sleep 300"], capture_output=True, text=True)
    mine = [p for p in out.stdout.split() if _cwd(int(p)) == node.work]
    assert mine == [], "a task of the lost launch survived"


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def test_launch_failure_with_several_tasks_ends_the_step(node: Node) -> None:
    node.start()
    job = node.submit("/nonexistent/program", opts=("--ntasks", "3"))
    j = node.wait_end(job, timeout=20)
    assert (j["state"], j["exit_code"]) == ("failed", 127)
    assert node.status()["cpus"]["allocated"] == 0


def test_tasks_start_with_no_ignored_or_blocked_signals(node: Node) -> None:
    node.start()
    job = node.submit("grep", "-E", "^Sig(Ign|Blk)", "/proc/self/status")
    j = node.wait_end(job)
    with open(j["output"]) as f:
        lines = f.read().split()
    assert lines == ["SigBlk:", "0000000000000000", "SigIgn:", "0000000000000000"]


def test_cancelling_a_pending_job_frees_nothing_it_did_not_hold(make_node: type[Node]) -> None:
    node = make_node(extra=["--memory-mb", "1000"])
    node.start()
    big = node.submit("sleep", "30", opts=("--memory-mb", "800"))
    node.wait_state(big, ("running",))
    pending = node.submit("true", opts=("--memory-mb", "700"))
    node.ok("cancel", str(pending))
    assert node.job(pending)["state"] == "cancelled"
    assert node.status()["memory_mb"]["allocated"] == 800
    again = node.submit("true", opts=("--memory-mb", "700"))
    assert node.job(again)["state"] == "pending", "memory was double-booked"
    node.ok("cancel", str(big))
    assert node.wait_end(again)["state"] == "completed"


def test_unanswered_orphan_ack_neither_spins_nor_blocks_stop(node: Node) -> None:
    node.start(env={"TETHER_AGENT_FAULT": "skip-ack"})
    job = node.submit("true")
    node.wait_end(job)
    sup = node.supervisor_pids()
    assert len(sup) == 1
    node.stop(signal.SIGKILL)
    os.kill(sup[0], signal.SIGSTOP)
    try:
        node.start()
        assert node.agent is not None
        t0 = _cpu_seconds(node.agent.pid)
        time.sleep(3)  # a measurement window, not synchronisation: the ack times out within it
        assert _cpu_seconds(node.agent.pid) - t0 < 1.0, "the agent spins on a dead ack link"
        t = time.monotonic()
        assert node.stop(signal.SIGTERM) == 0
        assert time.monotonic() - t < 5, "the agent hung on stop"
    finally:
        os.kill(sup[0], signal.SIGCONT)
    node.start()
    poll_until(lambda: not node.supervisor_pids(), 20, "the orphan to be acknowledged")


def test_a_failed_ack_is_retried_by_the_running_agent(node: Node) -> None:
    node.start(env={"TETHER_AGENT_FAULT": "skip-ack"})
    job = node.submit("true")
    node.wait_end(job)
    sup = node.supervisor_pids()
    node.stop(signal.SIGKILL)
    os.kill(sup[0], signal.SIGSTOP)
    try:
        node.start()  # its ack times out while the supervisor is stopped
        # a failed ack changes no state and gets no reply: the log line is its only trace,
        # and without it the supervisor could be resumed before the first ack timed out
        poll_until(lambda: "trying again" in _read(node.agent_logs[-1]), 20, "the ack to fail")
    finally:
        os.kill(sup[0], signal.SIGCONT)
    poll_until(lambda: not node.supervisor_pids(), 20, "the same agent to acknowledge it")


def test_a_half_removed_run_directory_of_an_ended_job_is_removed_and_nothing_else(
        node: Node) -> None:
    """Row 17: the supervisor dies after its ack reply, part way through removing its run
    directory. The job's record is final: the next agent start removes the rest of the
    directory and decides nothing (no second result, no requeue, nothing held)."""
    node.start(env={"TETHER_AGENT_FAULT": "skip-ack"})  # the supervisor waits, as for the ack
    job = node.submit("sh", "-c", "exit 5")
    ended = node.wait_end(job)
    assert (ended["state"], ended["exit_code"], ended["attempt"]) == ("failed", 5, 1)
    rd = node.layout.run_dir(job, 1)
    sup = ProcId.from_dict(node.manifest(job)["supervisor"])
    node.stop(signal.SIGKILL)
    os.kill(sup.pid, signal.SIGKILL)
    poll_until(lambda: not sup.alive(), 10, "the supervisor to die")
    for path in (rd.sentinel, rd.manifest, rd.ctl_sock, rd.sock):  # what its removal did
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    assert os.path.exists(rd.lock) and os.path.exists(rd.spec)
    node.start()  # the orphan pass runs before the agent serves
    assert not os.path.exists(rd.path), os.listdir(rd.path)
    j = node.job(job)
    assert {k: j[k] for k in ended} == ended, "the ended job's record changed"
    assert node.status()["cpus"]["allocated"] == 0
    assert node.supervisor_pids() == []


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_running_job_whose_run_dir_vanished_is_lost_not_requeued(node: Node) -> None:
    node.start()
    job = node.submit("sleep", "300")
    node.wait_state(job, ("running",))
    man = node.running_manifest(job)
    node.stop(signal.SIGKILL)
    for ident in (man["supervisor"], *man["tasks"]):
        os.kill(ident["pid"], signal.SIGKILL)
    poll_until(lambda: not ProcId.from_dict(man["supervisor"]).alive(), 10, "supervisor death")
    shutil.rmtree(node.layout.run_dir(job, 1).path)
    node.start()
    j = node.job(job)
    assert (j["state"], j["attempt"]) == ("lost", 1)
    assert node.status()["cpus"]["allocated"] == 0


def test_allocation_conflict_at_restart_is_not_adopted(make_node: type[Node]) -> None:
    """Only ids two running jobs claim are a conflict (a node restarted smaller keeps its
    running steps: tests/integration/test_exact_resources.py). Staged by editing the database."""
    node = make_node(cpus=4)
    node.start()
    first = node.submit("sleep", "30", opts=("--cpus", "2"))
    second = node.submit("sleep", "30", opts=("--cpus", "2"))
    node.wait_state(first, ("running",))
    node.wait_state(second, ("running",))
    node.stop(signal.SIGTERM)
    with sqlite3.connect(node.layout.db) as db:
        db.execute("UPDATE jobs SET cpus = '[1, 2]' WHERE id = ?", (second,))
    node.start()
    assert node.job(first)["state"] == "running"
    j = node.job(second)
    assert j["state"] == "lost" and "not adopted" in j["reason"]
    assert node.status()["cpus"] == {"total": 4, "allocated": 2}


def test_a_planted_socket_is_refused_and_the_real_supervisor_kept(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", "sleep 2; exit 4")
    beside = node.submit("sh", "-c", "sleep 1; exit 2")
    node.wait_state(job, ("running",))
    node.wait_state(beside, ("running",))
    rd = node.layout.run_dir(job, 1)
    node.stop(signal.SIGKILL)
    os.rename(rd.ctl_sock, rd.ctl_sock + ".real")
    impostor = subprocess.Popen([sys.executable, "-c", IMPOSTOR, rd.ctl_sock],
                                stdout=subprocess.PIPE)
    try:
        assert impostor.stdout is not None and impostor.stdout.readline() == b"bound\n"
        node.start()
        j = node.job(job)
        assert j["state"] == "running", "the agent believed a planted socket"
        b = node.wait_end(beside)  # the real supervisor beside it is adopted as usual
        assert (b["state"], b["exit_code"]) == ("failed", 2)
        with open(node.agent_logs[-1]) as f:  # the contract: refused *and logged* (row 23)
            assert "impostor" in f.read()
    finally:
        impostor.kill()
        impostor.wait()
        assert impostor.stdout is not None
        impostor.stdout.close()
    os.replace(rd.ctl_sock + ".real", rd.ctl_sock)
    j = node.wait_end(job, timeout=60)
    assert (j["state"], j["exit_code"]) == ("failed", 4)


IMPOSTOR = """
import sys, zmq, msgpack, os
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.bind("ipc://" + sys.argv[1])
print("bound", flush=True)
while True:
    ident, data = s.recv_multipart()
    req = msgpack.unpackb(data)
    res = {"role": "supervisor", "job": 1, "attempt": 1, "phase": "running", "pid": 1,
           "start_ticks": 1, "boot_id": "x", "protocol": 1}
    s.send_multipart([ident, msgpack.packb({"v": 1, "id": req["id"], "ok": True,
                                            "result": res})])
"""


def test_list_is_paged(node: Node) -> None:
    node.start()
    ids = [node.submit("true") for _ in range(3)]
    with Client(node.layout.sock) as c:
        first = c.call("list", {"limit": 2})
        rest = c.call("list", {"after": first["jobs"][-1]["id"], "limit": 2})
    assert [j["id"] for j in first["jobs"]] == ids[:2] and first["more"] is True
    assert [j["id"] for j in rest["jobs"]] == ids[2:] and rest["more"] is False
    assert proc_stat(os.getpid()) is not None


def test_stray_signals_do_not_kill_a_supervisor(node: Node) -> None:
    node.start()
    job = node.submit("sleep", "1")
    node.wait_state(job, ("running",))
    sup = ProcId.from_dict(node.running_manifest(job)["supervisor"])
    for sig in (signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        os.kill(sup.pid, sig)
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0)


def test_a_huge_command_line_is_refused_not_recorded(node: Node) -> None:
    node.start()
    res = node.cli("submit", "--", "echo", "x" * 100_000, "y" * 100_000)
    assert res.returncode == 1 and "longer than" in res.stderr
    assert node.ok("list", "--json") == "[]\n"


def test_an_output_opener_that_dies_silently_fails_the_job_with_a_reason(node: Node) -> None:
    # Found by the chaos run (its supervisor killer took an opener for its supervisor): the job
    # failed with an empty reason. A job of the supervisor's own user gets a thread, not a
    # forked opener, unless the thread cannot have a working directory of its own.
    node.start(env={"TETHER_SUPERVISOR_FAULT": "refuse-unshare,opener-dies"})
    job = node.submit("sh", "-c", "echo ran >> runs.txt")
    j = node.wait_end(job, timeout=30)
    assert (j["state"], j["exit_code"]) == ("failed", 127)
    assert j["reason"] and "the output opener" in j["reason"] and "without an answer" in \
        j["reason"], j["reason"]
    assert not os.path.exists(os.path.join(node.work, "runs.txt")), "the task ran regardless"
    assert node.status()["cpus"]["allocated"] == 0
