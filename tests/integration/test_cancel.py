"""Cancelling jobs: running (SIGTERM, then SIGKILL after the grace), pending, already ended."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from tests.helpers import Node, poll_until
from tether.shared.procid import ProcId

GRACE = 2.0  # the node fixture's agent runs with --cancel-grace 2


def _wait_file(node: Node, name: str) -> None:
    path = os.path.join(node.work, name)
    poll_until(lambda: os.path.exists(path), 30, f"{name} to appear\n{node.logs()}")


def _one_line_error(res: subprocess.CompletedProcess[str]) -> str:
    stderr = res.stderr.rstrip("\n")
    assert stderr, "expected an error message on stderr"
    assert "\n" not in stderr, f"stderr is more than one line: {stderr!r}"
    assert "Traceback" not in stderr
    return stderr


def test_cancel_kills_a_task_that_ignores_sigterm_after_the_grace(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c",
                      'trap "" TERM; echo started > started; while :; do sleep 0.1; done')
    _wait_file(node, "started")
    task = node.running_manifest(job)["tasks"][0]
    ident = ProcId(task["boot_id"], task["pid"], task["start_ticks"])
    assert ident.alive()

    t0 = time.monotonic()
    node.ok("cancel", str(job))
    end = node.wait_end(job, timeout=30)
    elapsed = time.monotonic() - t0

    assert end["state"] == "cancelled", end
    assert end["signal"] == signal.SIGKILL, end
    assert end["exit_code"] is None, end
    assert end["reason"].startswith("cancelled"), end
    assert elapsed >= GRACE, f"ended {elapsed:.2f}s after cancel, before the {GRACE}s grace"
    assert elapsed < GRACE + 15, f"ended only {elapsed:.2f}s after cancel"
    assert not ident.alive()
    assert node.status()["cpus"]["allocated"] == 0


def test_cancel_of_a_task_that_obeys_sigterm_does_not_wait_for_the_grace(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", "echo started > started; exec sleep 300")
    _wait_file(node, "started")
    node.running_manifest(job)
    node.ok("cancel", str(job))
    end = node.wait_end(job, timeout=30)
    # killed by the SIGTERM itself: no SIGKILL was needed, so none came after a grace period
    assert (end["state"], end["signal"]) == ("cancelled", signal.SIGTERM), end
    assert end["reason"].startswith("cancelled"), end


def test_cancel_pending_job_never_runs(node: Node) -> None:
    node.start()
    blocker = node.submit("sh", "-c", "touch held; while [ ! -e go ]; do sleep 0.05; done",
                          opts=("--cpus", "4"))
    _wait_file(node, "held")
    pending = node.submit("sh", "-c", "touch ran", opts=("--cpus", "1"))
    assert node.job(pending)["state"] == "pending"

    node.ok("cancel", str(pending))
    job = node.job(pending)
    assert job["state"] == "cancelled", job
    assert job["attempt"] == 0 and job["started_at"] is None and not job["pids"], job
    assert job["ended_at"], job

    # free the node; a later job runs, so the queue has moved past the cancelled one
    open(os.path.join(node.work, "go"), "w").close()
    assert node.wait_end(blocker)["state"] == "completed"
    later = node.submit("true")
    assert node.wait_end(later)["state"] == "completed"

    job = node.job(pending)
    assert job["state"] == "cancelled" and job["attempt"] == 0, job
    assert not os.path.exists(os.path.join(node.work, "ran")), "the cancelled job ran"
    assert not os.path.exists(node.layout.run_dir(pending, 1).path)
    assert node.status()["cpus"]["allocated"] == 0


def test_cancel_of_an_ended_job_is_a_one_line_error(node: Node) -> None:
    node.start()
    job = node.submit("true")
    before = node.wait_end(job)
    assert before["state"] == "completed"

    res = node.cli("cancel", str(job))
    assert res.returncode != 0
    err = _one_line_error(res)
    assert "already ended" in err, err
    assert node.job(job) == before
