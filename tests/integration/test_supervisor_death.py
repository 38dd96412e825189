"""A supervisor that dies: with tasks running (lost, tasks killed, resources freed) or after its
exit record (the true result, from the sentinel)."""

from __future__ import annotations

import os
import signal

from tests.helpers import Node, poll_until
from tether.shared.procid import ProcId


def test_supervisor_killed_mid_job_is_lost_and_cleaned_up(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", "sleep 300 & sleep 300; wait", opts=("--cpus", "2"))
    node.wait_state(job, ("running",))
    man = node.running_manifest(job)
    sup = ProcId.from_dict(man["supervisor"])
    tasks = [ProcId.from_dict(t) for t in man["tasks"]]
    os.kill(sup.pid, signal.SIGKILL)
    j = node.wait_state(job, ("lost",))
    assert j["reason"] and "died" in j["reason"]
    assert j["exit_code"] is None
    poll_until(lambda: not any(t.alive() for t in tasks), 10, "the task to be killed")
    session_left = [p for p in _session(man["session"]) if p != sup.pid]
    assert session_left == [], f"step processes survived: {session_left}"
    assert node.status()["cpus"]["allocated"] == 0


def test_supervisor_killed_while_agent_down_is_lost_at_restart(node: Node) -> None:
    node.start()
    job = node.submit("sleep", "300")
    node.wait_state(job, ("running",))
    man = node.running_manifest(job)
    node.stop(signal.SIGKILL)
    os.kill(man["supervisor"]["pid"], signal.SIGKILL)
    poll_until(lambda: not ProcId.from_dict(man["supervisor"]).alive(), 10, "supervisor death")
    node.start()
    j = node.job(job)
    assert j["state"] == "lost"
    poll_until(lambda: not ProcId.from_dict(man["tasks"][0]).alive(), 10, "the task to die")
    assert node.status()["cpus"]["allocated"] == 0


def test_supervisor_killed_after_exit_record_gives_true_result(node: Node) -> None:
    rd = node.end_while_down_then_kill_supervisor(3)
    node.start()
    j = node.job(rd.job)
    assert (j["state"], j["exit_code"]) == ("failed", 3)
    assert not os.path.exists(rd.path)


def test_tampered_sentinel_is_not_trusted(node: Node) -> None:
    rd = node.end_while_down_then_kill_supervisor(3)
    os.unlink(rd.sentinel)
    os.symlink("/etc/passwd", rd.sentinel)
    node.start()
    j = node.job(rd.job)
    assert j["state"] == "lost"
    assert "unusable exit record" in j["reason"]


def _session(sid: int) -> list[int]:
    from tether.shared.procid import all_processes
    return [st.pid for st in all_processes() if st.session == sid and not st.dead]
