"""The queue with a real agent (issue 13): backfill, pending reasons, arrays, dependencies,
holds, and all of it across an agent restart. The rules themselves are tabled over the pure
function in test_schedule.py; these runs check that the agent lives by them."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest

from tests.helpers import Node, poll_until
from tether.cli.timefmt import parse_stamp

GATED = "while [ ! -e {gate} ]; do sleep 0.05; done; exit {code}"


def stamp(job: dict[str, Any], key: str) -> float:
    value = parse_stamp(job[key])
    assert value is not None, f"job {job['id']} has no {key}"
    return value


def reason(node: Node, job: int) -> str:
    return str(node.job(job)["reason"])


def test_backfill_starts_a_short_job_in_the_gap_and_never_delays_the_blocked_one(
        make_node: Any) -> None:
    node: Node = make_node(cpus=4)
    node.start()
    gate = os.path.join(node.work, "go")
    # the gap: 1 CPU free beside a job that may run a minute (it ends when the gate opens)
    big = node.submit("sh", "-c", GATED.format(gate=gate, code=0),
                      opts=("--cpus", "3", "--time", "1"))
    node.wait_state(big, ("running",))
    blocked = node.submit("true", opts=("--cpus", "4"))
    short = node.submit("true", opts=("--time", "0:01"))
    endless = node.submit("true")  # no limit: it could delay the blocked job, so it waits
    assert node.wait_end(short)["state"] == "completed"
    assert node.job(blocked)["state"] == "pending" and reason(node, blocked) == "Resources"
    assert node.job(endless)["state"] == "pending" and reason(node, endless) == "Priority"
    listed = {j["id"]: j for j in json.loads(node.ok("list", "--json"))}
    assert (listed[blocked]["reason"], listed[endless]["reason"]) == ("Resources", "Priority")
    table = node.ok("list", "--format", "id,state,reason").splitlines()
    assert table[0].split() == ["ID", "STATE", "REASON"]
    assert f"{blocked} pending Resources" in [" ".join(r.split()) for r in table]
    open(gate, "w").close()
    for job in (blocked, endless):
        node.wait_end(job)
    j = {job: node.job(job) for job in (big, blocked, short, endless)}
    assert {x["state"] for x in j.values()} == {"completed"}
    assert stamp(j[short], "started_at") < stamp(j[big], "ended_at"), "not started in the gap"
    # the short job was gone before the blocked one could start, which started once the big
    # one ended; the job without a limit came after it
    assert stamp(j[short], "ended_at") <= stamp(j[blocked], "started_at")
    assert stamp(j[big], "ended_at") <= stamp(j[blocked], "started_at")
    assert stamp(j[blocked], "started_at") <= stamp(j[endless], "started_at")


def test_an_array_of_20_runs_at_most_5_at_once(make_node: Any) -> None:
    node: Node = make_node(cpus=8)
    node.start()
    out = node.ok("submit", "--array", "0-19%5", "--output", "a-%A_%a.out", "--",
                  "sh", "-c", "echo $TETHER_ARRAY_JOB_ID $TETHER_ARRAY_TASK_ID; sleep 0.2")
    array = int(out.strip())
    assert node.cli("wait", str(array), "--timeout", "60").returncode == 0
    jobs = [j for j in json.loads(node.ok("list", "--json")) if j["array_id"] == array]
    assert [j["array_index"] for j in jobs] == list(range(20))
    assert {j["state"] for j in jobs} == {"completed"}
    # the agent's records: never more than 5 elements between start and end at any moment
    edges = sorted([(stamp(j, "started_at"), 1) for j in jobs]
                   + [(stamp(j, "ended_at"), -1) for j in jobs])  # an end sorts before a start
    running = peak = 0
    for _, delta in edges:
        running += delta
        peak = max(peak, running)
    assert peak <= 5, f"{peak} elements ran at once"
    for j in jobs:
        with open(os.path.join(node.work, f"a-{array}_{j['array_index']}.out")) as f:
            assert f.read() == f"{array} {j['array_index']}\n"
    listing = node.ok("list", "--format", "id,state")
    assert f"{array}_19" in listing
    assert node.job(jobs[3]["id"])["array_index"] == 3
    shown = json.loads(node.ok("show", f"{array}_3", "--json"))
    assert shown["id"] == jobs[3]["id"]
    assert node.cli("show", f"{array}_20").returncode == 1

    # cancel ID: every element not ended yet, running and pending alike
    second = int(node.ok("submit", "--array", "1-6%2", "--", "sleep", "60").strip())
    poll_until(lambda: sum(j["state"] == "running" for j in json.loads(node.ok(
        "list", "--json")) if j["array_id"] == second) == 2, 30, "two elements running")
    node.stop(signal.SIGTERM)  # the array's state is the database's: a restart keeps it
    node.start()
    elements = [j for j in json.loads(node.ok("list", "--json")) if j["array_id"] == second]
    assert [j["state"] for j in elements].count("running") == 2
    assert {j["reason"] for j in elements if j["state"] == "pending"} == {"JobArrayTaskLimit"}
    inspected = json.loads(node.ok("inspect", f"{second}_1", "--json"))  # its supervisor
    assert (inspected["job"], inspected["state"]) == (second, "running")
    node.ok("cancel", f"{second}_6")  # one element alone
    assert node.job(second + 5)["state"] == "cancelled"
    assert node.job(second)["state"] == "running"
    node.ok("cancel", str(second))
    assert node.cli("wait", str(second), "--timeout", "30").returncode != 0
    states = [j["state"] for j in json.loads(node.ok("list", "--json"))
              if j["array_id"] == second]
    assert states == ["cancelled"] * 6


def test_afterok_chain_dependency_never_satisfied_and_holds_across_a_restart(
        make_node: Any) -> None:
    node: Node = make_node(cpus=4)
    node.start()
    gate = os.path.join(node.work, "go")
    first = node.submit("sh", "-c", GATED.format(gate=gate, code=3))
    second = node.submit("true", opts=("--dependency", f"afterok:{first}"))
    third = node.submit("true", opts=("--dependency", f"afterok:{second}"))
    other = node.submit("true", opts=("--dependency", f"afternotok:{first}"))
    anyway = node.submit("true", opts=("--dependency", f"afterany:{first},afterok:{other}"))
    held = node.submit("true", opts=("--hold",))
    later = node.submit("true")
    node.wait_state(first, ("running",))
    assert node.wait_end(later)["state"] == "completed"  # a free CPU: only the hold kept it
    assert (node.job(held)["state"], reason(node, held)) == ("pending", "JobHeldUser")
    for job in (second, third, other, anyway):
        assert reason(node, job) == "Dependency"
    assert node.cli("hold", str(first)).returncode == 1  # running: nothing to hold

    # holds, dependencies and the queue are the database's: an agent restart keeps them
    node.stop(signal.SIGTERM)
    node.start()
    assert reason(node, held) == "JobHeldUser" and reason(node, second) == "Dependency"
    node.ok("hold", str(other))
    open(gate, "w").close()
    assert node.cli("wait", str(first), "--timeout", "30").returncode == 3
    for job in (second, third):
        j = node.wait_state(job, ("cancelled",))
        assert j["reason"] == "DependencyNeverSatisfied"
    assert (node.job(other)["state"], reason(node, other)) == ("pending", "JobHeldUser")
    node.ok("release", str(other), str(held))
    for job in (other, anyway, held):
        assert node.wait_end(job)["state"] == "completed"
    bad = node.cli("submit", "--dependency", "afterok:999", "--", "true")
    assert (bad.returncode, bad.stderr) == (1, "tether: no job 999\n")


def test_jobs_beyond_what_a_pass_examines_wait_for_priority(make_node: Any) -> None:
    node: Node = make_node(cpus=1)
    node.start()
    gate = os.path.join(node.work, "go")
    head = node.submit("sh", "-c", GATED.format(gate=gate, code=0))
    node.wait_state(head, ("running",))
    array = int(node.ok("submit", "--array", "0-999", "--", "true").strip())
    assert json.loads(node.ok("show", f"{array}_0", "--json"))["reason"] == "Resources"
    for index in (1, 99, 100, 999):  # a pass plans for 100; the rest wait behind them too
        assert json.loads(node.ok("show", f"{array}_{index}", "--json"))["reason"] == "Priority"
    # a dependency on an array counts every element: 1,001 jobs are more than one may name
    res = node.cli("submit", "--dependency", f"afterok:{array},afterany:{head}", "--", "true")
    assert res.returncode == 1 and "more than 1000 jobs" in res.stderr, res.stderr
    node.ok("cancel", str(array))
    open(gate, "w").close()
    assert node.wait_end(head)["state"] == "completed"


def test_begin_time_holds_a_job_back_until_then(make_node: Any) -> None:
    node: Node = make_node(cpus=2)
    node.start()
    job = node.submit("true", opts=("--begin", "now+2"))
    j = node.job(job)
    assert (j["state"], j["reason"]) == ("pending", "BeginTime")
    later = node.submit("true")  # the CPU is free: only the begin time holds the first back
    assert node.wait_end(later)["state"] == "completed"
    assert node.job(job)["state"] == "pending"
    done = node.wait_end(job)  # no event but the time itself starts it
    assert done["state"] == "completed"
    assert stamp(done, "started_at") >= stamp(j, "begin_at")
    bad = node.cli("submit", "--begin", "soon", "--", "true")
    assert bad.returncode == 2 and "not a begin time" in bad.stderr


def test_a_suspended_job_has_no_end_to_backfill_by(make_node: Any) -> None:
    """Time suspended is not run time, so a suspended job may hold its resources for ever as far
    as planning goes: nothing is backfilled against its limit until it is resumed."""
    from tests.integration.test_cgroup import needs_freezer

    if needs_freezer.args[0]:
        pytest.skip(needs_freezer.kwargs["reason"])
    node: Node = make_node(cpus=2)
    node.start()
    gate = os.path.join(node.work, "go")
    first = node.submit("sh", "-c", GATED.format(gate=gate, code=0), opts=("--time", "1"))
    node.wait_state(first, ("running",))
    node.ok("suspend", str(first))
    blocked = node.submit("true", opts=("--cpus", "2"))
    short = node.submit("true", opts=("--time", "0:01"))
    later = node.submit("true", opts=("--cpus", "2"))  # an event: one more pass has run
    assert reason(node, later) == "Priority"
    assert (node.job(blocked)["reason"], node.job(short)["reason"]) == ("Resources", "Priority")
    node.ok("resume", str(first))  # its limit is known again: the short job fits the gap
    assert node.wait_end(short)["state"] == "completed"
    assert node.job(blocked)["state"] == "pending"
    open(gate, "w").close()
    for job in (first, blocked, later):
        assert node.wait_end(job)["state"] == "completed"
