"""Exact ids across an agent restart: the CPUs, GPUs and memory a running step holds are held
again, and an agent restarted smaller keeps a running step's holdings beyond its new size."""

from __future__ import annotations

import os
import signal

from tests.helpers import Node

GATE = "while [ ! -e {0} ]; do sleep 0.05; done"


def _gated(node: Node, name: str, opts: tuple[str, ...]) -> int:
    return node.submit("sh", "-c", GATE.format(name), opts=opts)


def _open(node: Node, name: str) -> None:
    open(os.path.join(node.work, name), "w").close()


def test_exact_cpus_gpus_and_memory_are_held_again_after_a_restart() -> None:
    node = Node(cpus=4, extra=["--gpus", "2", "--memory-mb", "1000"])
    try:
        node.start()
        first = _gated(node, "go1", ("--cpus", "1"))
        held = _gated(node, "go2", ("--cpus", "2", "--gpus", "1", "--memory-mb", "300"))
        node.wait_state(held, ("running",))
        _open(node, "go1")  # CPU 0 is free again; the held job keeps CPUs 1 and 2
        node.wait_end(first)
        before = node.job(held)
        assert (before["cpus"], before["gpus"]) == ([1, 2], [0])
        node.stop(signal.SIGKILL)
        node.start()
        st = node.status()
        assert (st["cpus"]["allocated"], st["gpus"]["allocated"],
                st["memory_mb"]["allocated"]) == (2, 1, 300)
        other = _gated(node, "go3", ("--cpus", "2", "--gpus", "1", "--memory-mb", "700"))
        j = node.wait_state(other, ("running",))
        assert (j["cpus"], j["gpus"]) == ([0, 3], [1]), "ids held by a running step reused"
        assert node.job(held)["state"] == "running"
        _open(node, "go2")
        _open(node, "go3")
        assert node.wait_end(held)["state"] == "completed"
        assert node.wait_end(other)["state"] == "completed"
        assert node.status()["memory_mb"]["allocated"] == 0
    finally:
        node.cleanup()


def test_an_agent_restarted_with_fewer_cpus_keeps_running_steps_holdings() -> None:
    node = Node(cpus=4)
    try:
        node.start()
        low = _gated(node, "go1", ("--cpus", "1"))
        high = _gated(node, "go2", ("--cpus", "2"))  # CPUs 1 and 2
        node.wait_state(high, ("running",))
        _open(node, "go1")
        node.wait_end(low)
        node.stop(signal.SIGKILL)
        node.args[node.args.index("--cpus") + 1] = "2"  # the node is now CPUs 0 and 1
        node.start()
        assert node.job(high)["state"] == "running", "a running step was not adopted"
        st = node.status()
        assert st["beyond_node"]["cpus"] == [2], st
        assert st["cpus"] == {"total": 2, "allocated": 1}
        assert "beyond     cpus 2 (held by running steps" in node.ok("status")
        # new work never gets CPU 1 while the old step holds it
        one = _gated(node, "go3", ("--cpus", "1"))
        assert node.wait_state(one, ("running",))["cpus"] == [0]
        two = node.submit("true", opts=("--cpus", "2"))
        assert node.job(two)["state"] == "pending"
        _open(node, "go2")
        assert node.wait_end(high)["state"] == "completed"
        assert node.status()["beyond_node"]["cpus"] == []
        _open(node, "go3")
        assert node.wait_end(one)["state"] == "completed"
        assert node.wait_end(two)["state"] == "completed"
    finally:
        node.cleanup()
