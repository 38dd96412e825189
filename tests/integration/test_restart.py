"""Agent restarts with jobs running, finished, pending and half-launched: nothing lost, nothing
run twice, nothing double-booked."""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers import Node, default_output, pid_alive, poll_until
from tether.shared import records
from tether.shared.procid import ProcId


def ticker(n: int, pause: float = 0.3) -> tuple[str, ...]:
    return ("sh", "-c", f"for i in $(seq 1 {n}); do echo line $i; sleep {pause}; done")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_restart_mid_job_keeps_the_job(node: Node, sig: int) -> None:
    node.start()
    job = node.submit(*ticker(10))
    node.wait_state(job, ("running",))
    man = node.running_manifest(job)
    sup = ProcId.from_dict(man["supervisor"])
    assert node.job(job)["supervisor_pid"] == sup.pid

    rc = node.stop(sig)
    if sig == signal.SIGTERM:
        assert rc == 0
    assert sup.alive(), "the supervisor died with its agent"
    assert man["tasks"] and all(ProcId.from_dict(t).alive() for t in man["tasks"]), \
        "a task died with the agent"

    node.start()
    j = node.job(job)
    assert j["state"] == "running"
    assert j["supervisor_pid"] == sup.pid
    assert node.manifest(job)["supervisor"] == sup.to_dict()  # same pid, same start time

    j = node.wait_end(job)
    assert (j["state"], j["exit_code"], j["attempt"]) == ("completed", 0, 1)
    with open(default_output(node.work, job)) as f:
        lines = f.read().splitlines()
    assert lines == [f"line {i}" for i in range(1, 11)], "output lost or duplicated"
    st = node.status()
    assert st["cpus"]["allocated"] == 0
    assert st["memory_mb"]["allocated"] == 0


@pytest.mark.parametrize("code,state", [(0, "completed"), (7, "failed")])
def test_exit_code_across_restart(node: Node, code: int, state: str) -> None:
    node.start()
    job = node.submit("sh", "-c", f"sleep 1.5; exit {code}")
    node.wait_state(job, ("running",))
    node.stop(signal.SIGTERM)
    node.start()
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"], j["signal"]) == (state, code, None)
    assert node.cli("wait", str(job)).returncode == code


def test_job_ends_while_agent_is_down(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", "sleep 0.5; exit 7")
    node.wait_state(job, ("running",))
    rd = node.layout.run_dir(job, 1)
    node.stop(signal.SIGKILL)
    rec = poll_until(lambda: os.path.exists(rd.sentinel) and records.read_sentinel(rd.sentinel),
                     30, "the exit record written while the agent is down")
    assert rec["exit_code"] == 7
    node.start()
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("failed", 7)
    poll_until(lambda: not os.path.exists(rd.path), 20, "the acknowledged run dir to go")
    # the supervisor exits once the agent acknowledged the result: soon after wait returns
    poll_until(lambda: node.supervisor_pids() == [], 10, "the supervisor to exit")


#: a job that runs until the test creates ``go`` in the working directory (no timing involved)
UNTIL_GO = ("sh", "-c", "while [ ! -e go ]; do sleep 0.05; done")


def test_no_double_booking_after_restart(node: Node) -> None:
    node.start()
    big = node.submit(*UNTIL_GO, opts=("--cpus", "4"))
    node.wait_state(big, ("running",))
    node.stop(signal.SIGKILL)
    node.start()
    assert node.status()["cpus"]["allocated"] == 4, "the restarted agent forgot the allocation"
    small = node.submit("true", opts=("--cpus", "1"))
    assert node.job(small)["state"] == "pending"
    assert node.job(big)["state"] == "running"
    open(os.path.join(node.work, "go"), "w").close()
    b = node.wait_end(big)
    s = node.wait_end(small)
    assert (b["state"], s["state"]) == ("completed", "completed")
    assert s["started_at"] >= b["ended_at"], "the small job ran on CPUs still held"


def test_pending_jobs_survive_restart_in_order(node: Node) -> None:
    node.start()
    blocker = node.submit(*UNTIL_GO, opts=("--cpus", "4"))
    queued = [node.submit("true", opts=("--cpus", "4")) for _ in range(3)]
    assert all(node.job(q)["state"] == "pending" for q in queued)
    node.stop(signal.SIGTERM)
    node.start()
    assert all(node.job(q)["state"] == "pending" for q in queued)
    open(os.path.join(node.work, "go"), "w").close()
    node.wait_end(blocker)
    done = [node.wait_end(q) for q in queued]
    assert [d["state"] for d in done] == ["completed"] * 3
    assert [d["attempt"] for d in done] == [1, 1, 1]
    starts = [d["started_at"] for d in done]
    assert starts == sorted(starts), "queued jobs did not run in submission order"


def test_agent_killed_between_spawn_and_claim_runs_once(node: Node) -> None:
    node.start(env={"TETHER_AGENT_FAULT": "stall-before-claim"})
    job = node.submit("sh", "-c", "echo ran >> runs.txt")
    rd = node.layout.run_dir(job, 1)
    poll_until(lambda: os.path.exists(rd.manifest)
               and records.read_manifest(rd.manifest)["phase"] == "ready",
               30, "the supervisor to be ready and unclaimed")
    assert node.job(job)["state"] == "starting"
    node.stop(signal.SIGKILL)
    node.start()
    j = node.wait_end(job)
    assert (j["state"], j["attempt"]) == ("completed", 1)
    with open(os.path.join(node.work, "runs.txt")) as f:
        assert f.read() == "ran\n", "the job ran more or less than once"


def test_unclaimed_supervisor_gives_up_and_the_job_is_requeued(make_node: type[Node]) -> None:
    node = make_node(extra=["--claim-timeout", "1"])
    node.start(env={"TETHER_AGENT_FAULT": "stall-before-claim"})
    job = node.submit("sh", "-c", "echo ran >> runs.txt")
    rd = node.layout.run_dir(job, 1)
    poll_until(lambda: os.path.exists(rd.manifest), 30, "the supervisor to be ready")
    node.stop(signal.SIGKILL)
    rec = poll_until(lambda: os.path.exists(rd.sentinel) and records.read_sentinel(rd.sentinel),
                     30, "the supervisor to give up and write a never-started record")
    assert rec["launched"] is False and rec["state"] == "aborted"
    poll_until(lambda: not node.supervisor_pids(), 20, "the supervisor to exit")
    node.start()
    j = node.wait_end(job)
    assert (j["state"], j["attempt"]) == ("completed", 2)
    with open(os.path.join(node.work, "runs.txt")) as f:
        assert f.read() == "ran\n"


def test_supervisor_outlives_the_agent_process_group(node: Node) -> None:
    """Signals sent to the agent's process group do not reach supervisors or tasks."""
    node.start()
    job = node.submit("sleep", "30")
    node.wait_state(job, ("running",))
    man = node.running_manifest(job)
    assert node.agent is not None
    os.killpg(node.agent.pid, signal.SIGKILL)
    node.agent.wait()
    assert ProcId.from_dict(man["supervisor"]).alive()
    assert pid_alive(man["tasks"][0]["pid"])
    node.start()
    node.ok("cancel", str(job))
    assert node.wait_end(job)["state"] == "cancelled"


def test_result_recorded_but_not_acknowledged_is_acked_at_restart(node: Node) -> None:
    """Agent dies after recording the result (C2) and before the ack (C3)."""
    node.start(env={"TETHER_AGENT_FAULT": "skip-ack"})
    job = node.submit("sh", "-c", "exit 5")
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("failed", 5)
    rd = node.layout.run_dir(job, 1)
    assert os.path.isdir(rd.path), "the supervisor should still wait for its ack"
    assert node.supervisor_pids(), "the supervisor should still wait for its ack"
    node.stop(signal.SIGKILL)
    node.start()
    poll_until(lambda: not node.supervisor_pids(), 20, "the acknowledged supervisor to exit")
    poll_until(lambda: not os.path.exists(rd.path), 20, "the run dir to be removed")
    j = node.job(job)
    assert (j["state"], j["exit_code"]) == ("failed", 5), "the result was recorded twice"
