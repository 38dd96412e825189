"""Clients across an agent restart, and a second agent on the same state directory."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.helpers import CLI, Node, poll_until

UNTIL_GO = ("sh", "-c", "while [ ! -e go ]; do sleep 0.05; done; exit 4")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_wait_answers_soon_after_the_end_across_an_agent_restart(node: Node,
                                                                 how: signal.Signals) -> None:
    """The parked wait dies with the old agent: the CLI must notice and ask the new one (it
    used to notice only at its own 40 s deadline)."""
    node.start()
    job = node.submit(*UNTIL_GO)
    node.wait_state(job, ("running",))
    waiter = subprocess.Popen([*CLI, "wait", str(job)], env=node.env, cwd=node.work,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        parked = _Parked(node)
        poll_until(lambda: waiter.poll() is not None or parked(), 10,
                   "the wait to be parked in the agent")
        node.stop(how)
        node.start()
        open(os.path.join(node.work, "go"), "w").close()
        node.wait_state(job, ("failed",))
        try:
            poll_until(lambda: waiter.poll() is not None, 10,
                       "tether wait to return after the job ended")
        except AssertionError:
            waiter.kill()
            raise AssertionError(f"tether wait did not return: {waiter.communicate()}") from None
        assert waiter.returncode == 4, waiter.communicate()
    finally:
        if waiter.poll() is None:
            waiter.kill()
        waiter.communicate()


def _connections(path: str) -> int:
    """Connected sockets accepted on the listener at ``path`` (from /proc/net/unix)."""
    n = 0
    with open("/proc/net/unix") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == path and fields[5] == "03":
                n += 1
    return n


class _Parked:
    """True once the CLI's wait connection has been up for several polls in a row (`show`'s
    own connection, just before it, comes and goes within one)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.seen = 0

    def __call__(self) -> bool:
        self.seen = self.seen + 1 if _connections(self.node.layout.sock) >= 1 else 0
        return self.seen >= 5


def test_a_second_agent_is_refused_even_when_agent_lock_was_removed(node: Node) -> None:
    node.start()
    first = node.agent
    assert first is not None
    os.unlink(os.path.join(node.state, "agent.lock"))
    second = subprocess.run([*CLI, "agent", "--state-dir", node.state, *node.args],
                            env=node.env, capture_output=True, text=True, timeout=30)
    assert second.returncode != 0
    assert "another agent" in second.stderr, second.stderr
    assert first.poll() is None
    job = node.submit("true")  # the first agent still serves its socket
    assert node.wait_end(job)["state"] == "completed"
