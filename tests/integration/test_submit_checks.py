"""No user can stall the submit path (issue 27, point 1): the check run as a submitting user
(agent/checks.py, agent/users.py) is hers to stop, so it has a deadline, a few in flight per
user, and a thread of its own: her stopped checks cost her own submissions only.

Users are created here and removed afterwards; their CLI runs as them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from tests.helpers import Node, foreign_python, poll_until
from tests.userkit import User, cli_as, home_for, made_users, shared
from tether.agent.checks import PER_USER

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")

#: Run as the hostile user: SIGSTOP every check shell of hers (``sh -c ... tether-check``) as
#: it appears, until WANT are stopped or SECONDS pass; prints each, then the most that were
#: stopped and alive at once.
STOPPER = r'''
import os, signal, sys, time
want, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
uid, stopped, most = os.getuid(), set(), 0

def stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return fields[0], int(fields[1])  # state, ppid

while len(stopped) < want and time.monotonic() < end:
    shells = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if b"tether-check" in f.read().split(b"\0"):
                    shells[int(name)] = stat(name)[1]
        except OSError:
            continue
    for pid, ppid in shells.items():
        if pid in stopped or ppid in shells:  # a subshell of a check ($(dirname ...)): no
            continue
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        stopped.add(pid)
        print("stopped", pid, flush=True)
    alive = 0
    for pid in stopped:
        try:
            alive += stat(pid)[0] == "T"
        except OSError:
            pass
    most = max(most, alive)
    time.sleep(0.002)
print("done", len(stopped), "most", most, flush=True)
'''


@pytest.fixture
def two() -> Iterator[list[User]]:
    with made_users(2) as users:
        yield users


def check_shells(uid: int) -> list[int]:
    """Live check shells of ``uid`` (zombies aside)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if b"tether-check" in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def test_stopped_checks_of_one_user_never_delay_another_users_submissions(
        make_node: type[Node], two: list[User]) -> None:
    """Bob stops 20 of his check shells (each submission of his checks 64 outputs, so the
    shell lives long enough to be caught) while he keeps submitting from 6 shells at once;
    meanwhile alice's 50 submissions and root's all succeed at once. Bob's are refused: the
    stopped ones at the deadline (2 s), naming it, and those over his cap of 4 at once with
    ``busy``; his stopped shells are killed, never more than 4 of them at a time."""
    alice, bob = two
    node = make_node(extra=["--submit-check-timeout", "2"])
    shared(node)
    alice_dir, bob_dir = home_for(node, alice), home_for(node, bob)
    node.start()
    python, penv = foreign_python()
    stopper = subprocess.Popen([*python, "-c", STOPPER, "20", "120"], user=bob.uid,
                               group=bob.gid, extra_groups=[], cwd="/", text=True,
                               env=dict(penv, PATH="/usr/bin:/bin"), stdout=subprocess.PIPE)
    bob_results: list[subprocess.CompletedProcess[str]] = []
    stop = threading.Event()

    def bob_submits() -> None:
        while not stop.is_set():
            bob_results.append(cli_as(bob, node, "submit", "--hold", "--array", "0-63",
                                      "--output", "o-%a", "--", "true", cwd=bob_dir))
    loops = [threading.Thread(target=bob_submits) for _ in range(6)]
    try:
        for t in loops:
            t.start()
        assert stopper.stdout is not None
        first = stopper.stdout.readline()
        assert first.startswith("stopped"), first
        took = []
        for _ in range(50):
            t0 = time.monotonic()
            res = cli_as(alice, node, "submit", "--hold", "--", "true", cwd=alice_dir)
            took.append(time.monotonic() - t0)
            assert res.returncode == 0, res.stderr
        t0 = time.monotonic()
        node.submit("true", opts=("--hold",))
        took.append(time.monotonic() - t0)
        out, _ = stopper.communicate(timeout=120)
    finally:
        stop.set()
        for t in loops:
            t.join(timeout=60)
        if stopper.poll() is None:
            stopper.kill()
            stopper.wait()
        for pid in check_shells(bob.uid):  # a failed run's, if any: the agent kills the rest
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    done = out.splitlines()[-1].split()
    assert done[:2] == ["done", "20"], out
    assert int(done[3]) <= PER_USER, out
    # nobody waited for a check of bob's: each well under the deadline
    assert max(took) < 2.0, took
    errors = [r.stderr for r in bob_results if r.returncode != 0]
    late = [e for e in errors if "did not finish within 2s" in e]
    busy = [e for e in errors if f"(at most {PER_USER} at once)" in e]
    assert len(late) >= 20 and busy, errors[:5]
    assert len(late) + len(busy) == len(errors), errors
    # every check shell of bob's was killed, stopped or not
    poll_until(lambda: not check_shells(bob.uid), 10, "bob's check shells to be gone")


def test_the_agent_stopping_kills_the_checks_it_started(make_node: type[Node],
                                                        two: list[User]) -> None:
    """A check stopped by its user outlived a stopped agent, stopped for good; now the agent
    kills every check still running as it stops."""
    _, bob = two
    node = make_node(extra=["--submit-check-timeout", "60"])
    shared(node)
    bob_dir = home_for(node, bob)
    node.start()
    python, penv = foreign_python()
    stopper = subprocess.Popen([*python, "-c", STOPPER, "1", "60"], user=bob.uid,
                               group=bob.gid, extra_groups=[], cwd="/", text=True,
                               env=dict(penv, PATH="/usr/bin:/bin"), stdout=subprocess.PIPE)
    results: list[subprocess.CompletedProcess[str]] = []
    submitter = threading.Thread(target=lambda: results.append(cli_as(
        bob, node, "submit", "--hold", "--array", "0-63", "--output", "o-%a", "--", "true",
        cwd=bob_dir)))
    try:
        submitter.start()
        out, _ = stopper.communicate(timeout=60)
        assert out.splitlines()[-1].startswith("done 1"), out
        assert check_shells(bob.uid)
        node.stop()
        poll_until(lambda: not check_shells(bob.uid), 10, "bob's stopped check to be killed")
    finally:
        submitter.join(timeout=60)
        if stopper.poll() is None:
            stopper.kill()
            stopper.wait()
        for pid in check_shells(bob.uid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert results and results[0].returncode == 1, results
