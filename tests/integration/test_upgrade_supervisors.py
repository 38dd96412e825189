"""``tether upgrade-supervisors``: each running supervisor re-executes itself into the installed
tether, keeping its pid, its tasks, its socket, its lock and its state (supervisor/handover.py).
The installed tether is this very build: re-executing into the same version is how the
mechanism is proven (the generation counts the re-execs)."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from tests.helpers import CLI, Node, poll_until
from tests.integration.test_mpi import _lines, _pmi, programs  # noqa: F401  (the fixture, built once)
from tether.shared.step_client import connect

TICKER = ("i=0; while [ ! -e gate ]; do i=$((i+1)); echo tick $i; echo err $i >&2; "
          "sleep 0.02; done; echo done")


def hello(node: Node, job: int) -> dict[str, Any]:
    with connect(job, state_dir=node.state) as step:
        return dict(step.hello)


def test_a_ticking_job_keeps_its_supervisor_tasks_and_every_byte(node: Node) -> None:
    node.env["TETHER_AUDIT_IMPORTS"] = "1"  # the old image imports nothing to hand over
    node.start()
    job = node.submit("sh", "-c", TICKER, opts=("--error", "err-%j"))
    node.wait_state(job, ("running",))
    before = hello(node, job)
    pids_before = json.loads(node.ok("inspect", str(job), "--pids", "--json"))
    out_path = os.path.join(node.dir, "attached.out")
    with open(out_path, "wb") as out:
        follower = subprocess.Popen([*CLI, "attach", str(job)], stdout=out,
                                    stderr=subprocess.PIPE, env=node.env, cwd=node.work)
    try:
        poll_until(lambda: os.path.getsize(out_path) > 0, 30, "the follower to print")
        for _ in range(2):  # twice: the second re-exec is done by a re-executed supervisor
            res = node.cli("upgrade-supervisors")
            assert res.returncode == 0, res.stderr + node.logs()
            assert f"job {job}: supervisor {before['pid']}" in res.stdout
        after = hello(node, job)
        assert (after["pid"], after["start_ticks"], after["boot_id"]) == (
            before["pid"], before["start_ticks"], before["boot_id"])
        assert (before["generation"], after["generation"]) == (0, 2)
        pids_after = json.loads(node.ok("inspect", str(job), "--pids", "--json"))
        assert [t["pid"] for t in pids_after["tasks"]] == [t["pid"] for t in pids_before["tasks"]]
        assert pids_after["tasks"] and all(t["alive"] for t in pids_after["tasks"])
        open(os.path.join(node.work, "gate"), "w").close()
        j = node.wait_end(job, timeout=60)
        assert (j["state"], j["exit_code"]) == ("completed", 0), j
        _, err = follower.communicate(timeout=60)
        assert follower.returncode == 0, err
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    with open(j["output"], "rb") as f:
        written = f.read()
    lines = written.decode().splitlines()
    assert lines[-1] == "done" and lines[:-1] == [f"tick {i}" for i in range(1, len(lines))]
    with open(out_path, "rb") as f:
        assert f.read() == written  # the follower lost and repeated nothing
    with open(os.path.join(node.state, "supervisors.log")) as f:
        log = f.read()
    assert log.count("re-executed as tether") == 2  # they logged here: the next can fail
    assert "late import" not in log


def test_a_4_rank_mpi_job_waiting_in_a_barrier_completes(
        node: Node, programs: dict[str, str]) -> None:  # noqa: F811
    node.start()
    go = os.path.join(node.work, "go")
    job = node.submit(programs["hello"], opts=("--ntasks", "4", "--pmi", "pmi1", "--env",
                                               f"HELLO_WAIT_FILE={go}"))
    poll_until(lambda: (s := _pmi(node, job)) and s["waiting"] == [1, 2, 3] and s,
               30, "ranks 1-3 to wait in the PMI barrier while rank 0 holds back")
    before = hello(node, job)
    res = node.cli("upgrade-supervisors", str(job))
    assert res.returncode == 0, res.stderr + node.logs()
    after = hello(node, job)
    assert (after["pid"], after["start_ticks"], after["generation"]) == (
        before["pid"], before["start_ticks"], 1)
    snap = _pmi(node, job)
    assert snap is not None and snap["waiting"] == [1, 2, 3]  # the barrier survived the exec
    with open(go, "w"):
        pass
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0), j["reason"]
    assert len([line for line in _lines(j["output"]) if " OK " in line]) == 4
