"""Launch is all-or-nothing: any error while starting the tasks (here EMFILE, from a lowered
RLIMIT_NOFILE on the supervisor) ends the job `failed` with the reason, and leaves no task."""

from __future__ import annotations

import os
import resource
import signal

import pytest

from tests.helpers import Node, pid_alive, poll_until
from tether.shared import records
from tether.shared.procid import ProcId


@pytest.mark.parametrize("spare_fds", [2, 8], ids=["in-the-PMI-setup", "mid-launch"])
def test_running_out_of_fds_during_launch_fails_the_job_and_leaves_no_task(
        spare_fds: int) -> None:
    node = Node(cpus=8)
    try:
        # The supervisor is left ready (unclaimed) so its limit can be lowered before launch.
        node.start(env={"TETHER_AGENT_FAULT": "stall-before-claim"})
        job = node.submit("sleep", "300", opts=("--ntasks", "8", "--pmi", "pmi1"))
        rd = node.layout.run_dir(job, 1)
        poll_until(lambda: os.path.exists(rd.manifest)
                   and records.read_manifest(rd.manifest)["phase"] == "ready", 30,
                   "the supervisor to be ready")
        sup = ProcId.from_dict(records.read_manifest(rd.manifest)["supervisor"])
        limit = len(os.listdir(f"/proc/{sup.pid}/fd")) + spare_fds
        resource.prlimit(sup.pid, resource.RLIMIT_NOFILE, (limit, limit))
        node.stop(signal.SIGKILL)
        node.start()  # no fault now: it claims, and the launch runs out of fds
        j = node.wait_end(job, timeout=30)
        assert (j["state"], j["exit_code"]) == ("failed", 127), j
        assert "Too many open files" in j["reason"]
        poll_until(lambda: not sup.alive(), 10, "the supervisor to exit")
        assert not [p for p in j["pids"] if pid_alive(p)], "a task of the failed launch lives"
        assert not node.supervisor_pids()
        assert node.status()["cpus"]["allocated"] == 0
    finally:
        node.cleanup()
