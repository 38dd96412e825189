"""Per-user limits and fair order (issue 27, point 3; Slurm's MaxSubmitJobs, MaxJobs and fair
share): one user's burst of submissions is cut at her pending limit with a clear error, her
running jobs at her running limit, and the pending queue is ordered by recent usage, so that
another user's job starts in the first pass after resources free. The rules' arithmetic is
tabled over the pure parts (``fairshare``, ``schedule.plan``); the users are real ones."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import Node, poll_until
from tests.userkit import User, cli_as, home_for, made_users, ok_as, run_as, shared
from tether.agent import fairshare, schedule
from tether.agent.schedule import Pending, Res, Running

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")

#: a job that runs until the file JOBID.go appears in its working directory
GATED = 'while [ ! -e "$TETHER_JOB_ID.go" ]; do sleep 0.05; done'

#: Run as a user: ``python -c BURST STATE_DIR WORKDIR N``: N submissions of GATED one after
#: the other through the agent's client, each answered before the next; prints how many were
#: accepted, then each distinct refusal with its count.
BURST = r'''
import collections, os, sys
from tether.shared.client import Client
from tether.shared.errors import TetherError
from tether.shared.paths import Layout
state, workdir, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
gated = 'while [ ! -e "$TETHER_JOB_ID.go" ]; do sleep 0.05; done'
args = {"command": ["sh", "-c", gated], "workdir": workdir, "env": {"PATH": "/usr/bin:/bin"},
        "umask": 0o022, "output": "/dev/null"}
ok, refused = 0, collections.Counter()
with Client(Layout(state).sock, timeout=60) as c:
    for _ in range(n):
        try:
            c.call("submit", args)
            ok += 1
        except TetherError as exc:
            refused[(getattr(exc, "code", "?"), exc.message)] += 1
print("accepted", ok)
for (code, message), count in refused.items():
    print("refused", count, code, message)
'''


@pytest.fixture
def two() -> Iterator[list[User]]:
    with made_users(2) as users:
        yield users


def jobs_of(node: Node, user: User) -> list[dict[str, Any]]:
    return [j for j in json.loads(node.ok("list", "--json")) if j["user"] == user.name]


def submit_as(node: Node, user: User, work: str, *opts: str) -> int:
    return int(ok_as(user, node, "submit", "--workdir", work, "--output", "/dev/null", *opts,
                     "--", "sh", "-c", GATED).strip())


def release(work: str, job: int) -> None:
    open(os.path.join(work, f"{job}.go"), "w").close()


# ---- the pure parts --------------------------------------------------------------------------

def test_usage_decays_by_its_half_life() -> None:
    usage = fairshare.Usage(half_life=100.0)
    usage.add(1, 400.0, at=1000.0)
    assert usage.value(1, 1000.0) == 400.0
    assert usage.value(1, 1100.0) == pytest.approx(200.0)
    assert usage.value(1, 1300.0) == pytest.approx(50.0)
    usage.add(1, 50.0, at=1300.0)
    assert usage.value(1, 1400.0) == pytest.approx(50.0)
    assert usage.now(1000.0 + 100.0 * 40) == {}  # negligible: forgotten


@pytest.mark.parametrize("usage, expect", [
    ({}, {}),
    ({1: 0.0, 2: 0.0}, {1: 1.0, 2: 1.0}),           # nobody used anything: all equal
    ({1: 100.0, 2: 100.0}, {1: 0.5, 2: 0.5}),       # used as much: each half
    ({1: 100.0, 2: 0.0}, {1: 0.25, 2: 1.0}),        # all of it one's: 2 ** -2
    ({1: 300.0, 2: 100.0}, {1: 2 ** -1.5, 2: 2 ** -0.5}),
])
def test_the_fair_share_factor_is_slurms_classic_one(usage: dict[int, float],
                                                     expect: dict[int, float]) -> None:
    got = fairshare.factors(usage)
    assert got == pytest.approx(expect)


def test_a_user_without_usage_has_the_top_priority() -> None:
    got = fairshare.factors({1: 50.0}, users=[2])
    assert got[2] == 1.0 and got[1] < 1.0
    assert fairshare.priority(got[2]) == fairshare.SCALE


def test_plan_holds_a_user_at_her_running_limit_without_blocking_others() -> None:
    pending = [Pending(1, Res(1), user=7), Pending(2, Res(1), user=7), Pending(3, Res(1), user=8),
               Pending(4, Res(1))]
    plan = schedule.plan(pending, [Running(9, Res(1))], Res(8), 0.0, by_user={7: 1},
                         max_running=2)
    assert plan.start == [1, 3, 4]
    assert plan.reasons == {2: schedule.USER_LIMIT}
    # the limit counts what the pass itself starts, and 0 means none
    assert schedule.plan(pending, [], Res(8), 0.0, by_user={7: 1}, max_running=0).start == \
        [1, 2, 3, 4]


def test_a_job_held_by_the_running_limit_reserves_nothing() -> None:
    """EASY backfill's reservation goes to the first job that may start, not one its user's
    limit holds: the small job behind it starts."""
    pending = [Pending(1, Res(4), user=7), Pending(2, Res(1), user=8)]
    plan = schedule.plan(pending, [Running(9, Res(3), end=100.0)], Res(1), 0.0,
                         by_user={7: 1}, max_running=1)
    assert plan.start == [2] and plan.blocked is None
    assert plan.reasons == {1: schedule.USER_LIMIT}


# ---- a real agent ----------------------------------------------------------------------------

@needs_root
def test_5000_submits_of_one_user_leave_anothers_job_first_once_resources_free(
        make_node: Any, two: list[User]) -> None:
    """alice submits 5,000 jobs one after the other: past 1,000 pending (the default limit)
    each is refused in one line naming it. bob's one job then waits behind her running ones,
    first in the queue (alice has used the node, bob not): the pass after one of her jobs ends
    starts bob's, not one of her 998."""
    node: Node = make_node(cpus=2)
    alice, bob = two
    shared(node)
    node.start()
    work = home_for(node, alice)
    bob_work = home_for(node, bob)
    res = run_as(alice, ["-c", BURST, node.state, work, "5000"], timeout=600)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    accepted = int(lines[0].split()[1])
    assert 1000 <= accepted <= 1002, lines  # 1,000 pending, and the 2 that started meanwhile
    refusals = [line.split(" ", 3) for line in lines[1:]]
    assert sum(int(r[1]) for r in refusals) == 5000 - accepted, lines
    assert {r[2] for r in refusals} == {"limit"}, lines
    assert all("--max-queued-per-user" in r[3] and "\n" not in r[3] for r in refusals)
    mine = jobs_of(node, alice)
    running = [j["id"] for j in mine if j["state"] == "running"]
    assert len(running) == 2 and sum(j["state"] == "pending" for j in mine) == 1000
    # the CLI says it in one line too
    refused = cli_as(alice, node, "submit", "--workdir", work, "--", "true")
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused
    assert "--max-queued-per-user" in refused.stderr, refused.stderr

    theirs = submit_as(node, bob, bob_work)
    shown = node.job(theirs)
    assert shown["state"] == "pending" and shown["reason"] == "Resources", shown
    table = node.ok("list", "--state", "pending", "--format", "id,user,priority,reason")
    rows = [r.split() for r in table.splitlines()[1:]]
    by_id = {int(r[0]): r for r in rows}
    assert int(by_id[theirs][2]) == fairshare.SCALE, by_id[theirs]
    assert all(int(r[2]) < fairshare.SCALE and r[3] == "Priority"
               for i, r in by_id.items() if i != theirs), rows[:3]

    release(work, running[0])  # one CPU frees
    poll_until(lambda: node.job(theirs)["state"] == "running", 30, "bob's job to start")
    started = [j["id"] for j in jobs_of(node, alice) if j["state"] in ("starting", "running")]
    assert started == [running[1]], "one of alice's pending jobs started before bob's"
    release(bob_work, theirs)
    assert node.wait_end(theirs)["state"] == "completed"


@needs_root
def test_a_user_at_her_running_limit_waits_and_others_run(make_node: Any,
                                                           two: list[User]) -> None:
    node: Node = make_node(cpus=4, extra=["--max-running-per-user", "2",
                                          "--max-queued-per-user", "3"])
    alice, bob = two
    shared(node)
    node.start()
    work, bob_work = home_for(node, alice), home_for(node, bob)
    ids = [submit_as(node, alice, work) for _ in range(4)]
    for job in ids[:2]:
        node.wait_state(job, ("running",))
    for job in ids[2:]:
        j = node.job(job)
        assert j["state"] == "pending" and j["reason"] == "QOSMaxJobsPerUserLimit", j
    shown = ok_as(alice, node, "show", str(ids[2]))
    assert "QOSMaxJobsPerUserLimit" in shown
    # bob is not held by alice's limit: his job takes a free CPU at once
    theirs = submit_as(node, bob, bob_work)
    node.wait_state(theirs, ("running",))
    # alice's pending limit: 2 pending now, an array of 2 would pass 3
    refused = cli_as(alice, node, "submit", "--workdir", work, "--array", "0-1", "--", "true")
    assert refused.returncode == 1 and "--max-queued-per-user" in refused.stderr, refused
    # root is not limited
    for _ in range(4):
        node.submit("true", opts=("--hold",))
    release(work, ids[0])
    node.wait_state(ids[2], ("running",))
    assert node.job(ids[3])["reason"] == "QOSMaxJobsPerUserLimit"
    for job in ids[1:]:
        release(work, job)
    release(bob_work, theirs)
    for job in [*ids, theirs]:
        assert node.wait_end(job)["state"] == "completed"
