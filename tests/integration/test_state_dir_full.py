"""A full state directory while jobs end: nothing is lost, nothing wedges, and the results are
recorded within seconds of space returning, without an agent restart."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from tests.helpers import Node, poll_until

UNTIL_GO = ("sh", "-c", "while [ ! -e go ]; do sleep 0.05; done")


@pytest.fixture
def small_node() -> Iterator[Node]:
    """A node whose state directory is a 4 MiB tmpfs of its own."""
    n = Node(cpus=4)
    os.makedirs(n.state)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", n.state],
                   check=True)
    try:
        yield n
    finally:
        n.cleanup()  # kills the agent and every supervisor and task first
        subprocess.run(["umount", "-l", n.state], check=False)
        shutil.rmtree(n.dir, ignore_errors=True)


def _fill(path: str) -> None:
    """Write zeros until the filesystem is full."""
    chunk = b"\0" * 65536
    # unbuffered: a buffered file keeps what the last write could not place and fails again
    # when closed (ENOSPC out of the with), depending on how the free space falls in chunks
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def test_results_are_recorded_once_space_returns(small_node: Node) -> None:
    node = small_node
    node.start()
    assert node.agent is not None
    agent_pid = node.agent.pid
    jobs = [node.submit(*UNTIL_GO) for _ in range(3)]
    for job in jobs:
        node.wait_state(job, ("running",))
    filler = os.path.join(node.state, "filler")
    _fill(filler)

    open(os.path.join(node.work, "go"), "w").close()
    # while the disk is full: submits are refused, naming the cause, and nothing is lost
    refused = poll_until(lambda: (r := node.cli("submit", "--", "true")).returncode != 0 and r,
                         30, "a submit to be refused while the state directory is full")
    assert "state directory full" in refused.stderr, refused.stderr
    for job in jobs:  # each step has ended: its supervisor holds the result in memory
        poll_until(lambda j=job: _phase(node, j) == "exited", 30, f"job {job}'s step to end")
    assert all(node.job(j)["state"] in ("running", "completed") for j in jobs)

    os.unlink(filler)
    for job in jobs:
        assert node.wait_state(job, ("completed", "failed", "lost"), timeout=10)["state"] \
            == "completed", node.logs()
    assert node.agent.poll() is None and node.agent.pid == agent_pid, "the agent restarted"
    assert node.status()["cpus"]["allocated"] == 0
    later = node.submit("true")
    assert node.wait_end(later)["state"] == "completed"


def _phase(node: Node, job: int) -> str | None:
    res = node.cli("inspect", str(job), "--json")
    if res.returncode != 0:
        return None
    import json
    return str(json.loads(res.stdout).get("phase"))
