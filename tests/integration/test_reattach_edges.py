"""Reattach when a supervisor is hung, when the node has rebooted, and introspection without an
agent."""

from __future__ import annotations

import json
import os
import signal

from tests.helpers import Node, poll_until
from tether.shared import records
from tether.shared.procid import ProcId


def test_hung_supervisor_is_unresponsive_not_lost(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", "sleep 1; echo done", opts=("--cpus", "3"))
    node.wait_state(job, ("running",))
    sup = ProcId.from_dict(node.running_manifest(job)["supervisor"])
    os.kill(sup.pid, signal.SIGSTOP)
    try:
        node.stop(signal.SIGKILL)
        node.start()  # serves at once; the hung supervisor's hello times out meanwhile
        j = node.job(job)
        assert j["state"] == "running", "a hung supervisor must never be declared lost"
        assert node.status()["cpus"]["allocated"] == 3, "its allocation must stay reserved"

        # the probe's verdict changes no state (the point: still running, still held), and row
        # 18's contract is that it is logged; the line says the hello has timed out by now
        def said_alive() -> bool:
            with open(node.agent_logs[-1]) as f:
                return "alive" in f.read()
        poll_until(said_alive, 30, "the agent to find the hung supervisor alive")
        assert node.job(job)["state"] == "running"
    finally:
        os.kill(sup.pid, signal.SIGCONT)
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0)
    assert node.status()["cpus"]["allocated"] == 0


def test_inspect_talks_to_the_supervisor_while_the_agent_is_down(node: Node) -> None:
    node.start()
    job = node.submit("sleep", "30")
    node.wait_state(job, ("running",))
    man = node.running_manifest(job)
    node.stop(signal.SIGTERM)
    st = json.loads(node.ok("inspect", str(job), "--json"))
    assert st["state"] == "running"
    assert st["supervisor_pid"] == man["supervisor"]["pid"]
    assert st["pids"] == [man["tasks"][0]["pid"]]
    plain = node.ok("inspect", str(job))
    assert "running" in plain
    node.start()
    node.ok("cancel", str(job))
    assert node.wait_end(job)["state"] == "cancelled"
    res = node.cli("inspect", str(job))
    assert res.returncode == 1 and "no supervisor" in res.stderr


def _simulate_reboot(node: Node, job: int) -> None:
    """Make the run dir look as if it came from an earlier boot of this node."""
    rd = node.layout.run_dir(job, 1)
    man = records.read_manifest(rd.manifest)
    man["supervisor"]["boot_id"] = "00000000-0000-0000-0000-000000000000"
    for task in man["tasks"]:
        task["boot_id"] = man["supervisor"]["boot_id"]
    records.atomic_write_json(rd.manifest, man)


def test_after_a_reboot_unfinished_steps_are_lost_and_finished_ones_stand(node: Node) -> None:
    node.start()
    finished = node.submit("sh", "-c", "exit 9")
    unfinished = node.submit("sleep", "300")
    node.wait_state(unfinished, ("running",))
    node.wait_state(finished, ("failed",))
    node.stop(signal.SIGKILL)
    man = node.running_manifest(unfinished)
    # "Reboot": every process of the step is gone (power cut), the spool is what remains.
    for st in (man["supervisor"], *man["tasks"]):
        os.kill(st["pid"], signal.SIGKILL)
    poll_until(lambda: not ProcId.from_dict(man["supervisor"]).alive(), 10, "supervisor death")
    _simulate_reboot(node, unfinished)
    node.start()
    j = node.job(unfinished)
    assert j["state"] == "lost" and "no exit record" in j["reason"]
    assert node.job(finished)["exit_code"] == 9
    assert node.status()["cpus"]["allocated"] == 0


def test_sentinel_from_before_a_reboot_gives_the_true_result(node: Node) -> None:
    rd = node.end_while_down_then_kill_supervisor(6)
    _simulate_reboot(node, rd.job)
    node.start()
    j = node.job(rd.job)
    assert (j["state"], j["exit_code"]) == ("failed", 6)
