"""The cluster schedules as one node does (shared/cluster_sched.py): fair-share order, EASY
backfill against every node's announced ends, pending reasons, and a node's dependency kinds,
across nodes. Real PostgreSQL, two agents (``tests/clusterkit.py``); and an upgrade from
schema version 2."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from tests.clusterkit import MARGIN, TIMEOUT, Cluster, node_dsn
from tests.helpers import poll_until
from tests.pgserver import ScratchPostgres
from tests.userkit import made_users
from tether.shared.cluster_sql import META, MIGRATIONS


def gate(name: str) -> str:
    """A shell loop that holds its job until ``opened(name)``."""
    return f"while [ ! -e {name} ]; do sleep 0.05; done"


def opened(cluster: Cluster, name: str) -> None:
    open(os.path.join(cluster.work, name), "w").close()


def shown(cluster: Cluster, job: int) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(cluster.ok("show", str(job), "--json"))
    return out


def reason_is(cluster: Cluster, job: int, reason: str) -> dict[str, Any]:
    """Poll until ``show`` gives the pending job ``reason`` (the next plan writes it)."""
    def check() -> dict[str, Any] | None:
        got = shown(cluster, job)
        assert got["state"] == "pending", got
        return got if got["reason"] == reason else None
    return poll_until(check, 15, f"job {job} pending for {reason}")


def running(cluster: Cluster, job: int) -> dict[str, Any]:
    return cluster.wait_job(job, lambda j: j["state"] == "running", "running")


def claimed_at(cluster: Cluster, job: int) -> Any:
    return cluster.attempts(job)[-1]["claimed_at"]


def test_the_queue_is_taken_in_fair_share_order_across_nodes(cluster: Cluster) -> None:
    cluster.agents("n0", "n1", cpus=1)
    with made_users(1) as [alice]:
        gates = [cluster.submit("sh", "-c", gate(f"g{i}")) for i in range(2)]  # root's
        for job in gates:
            running(cluster, job)
        heavy = cluster.put("true")  # root's, first in: oldest first would start it first
        light = cluster.put("true", uid=alice.uid, user=alice.name, gid=alice.gid)
        cluster.sql("INSERT INTO tether_usage VALUES (0, 1e6, "
                    "extract(epoch FROM clock_timestamp()))")  # root used the cluster lately
        first = reason_is(cluster, light, "Resources")  # blocked: the first in the order
        second = reason_is(cluster, heavy, "Priority")
        assert first["priority"] == 1_000_000 and 0 < second["priority"] < 500_000
        listed = cluster.ok("list", "--format", "id,priority,reason")
        assert any(line.split() == [str(heavy), str(second["priority"]), "Priority"]
                   for line in listed.splitlines()), listed
        opened(cluster, "g0")  # one CPU frees, on one node: alice's job takes it
        cluster.wait_job(light, lambda j: j["state"] == "completed", "completed")
        cluster.wait_job(heavy, lambda j: j["state"] == "completed", "completed")
        assert claimed_at(cluster, light) < claimed_at(cluster, heavy)
        opened(cluster, "g1")
        for job in gates:
            cluster.wait_job(job, lambda j: j["state"] == "completed", "completed")


def test_easy_backfill_across_nodes_keeps_the_blocked_jobs_reservation(
        cluster: Cluster) -> None:
    """n0: a 1-CPU job with a limit (its end is announced); n1: a 2-CPU job without one. A
    2-CPU job is then blocked and reserves n0 at the first one's end: a 1-CPU job that ends by
    then runs on n0 at once, one that would run past it (or has no limit) waits."""
    cluster.agents("n0", "n1")  # 2 CPUs each
    cluster.ok("drain", "n1")
    first = cluster.submit("sh", "-c", gate("ga"), opts=("--cpus", "1", "--time", "2:00"))
    assert running(cluster, first)["node"] == "n0"
    cluster.ok("resume", "n1")
    whole = cluster.submit("sh", "-c", gate("gb"), opts=("--cpus", "2"))
    assert running(cluster, whole)["node"] == "n1"
    big = cluster.submit("true", opts=("--cpus", "2", "--time", "1:00"))
    unlimited = cluster.submit("true", opts=("--cpus", "1"))
    too_long = cluster.submit("true", opts=("--cpus", "1", "--time", "10:00"))
    short = cluster.submit("true", opts=("--cpus", "1", "--time", "0:30"))
    done = cluster.wait_job(short, lambda j: j["state"] == "completed", "backfilled")
    assert done["node"] == "n0"
    reason_is(cluster, big, "Resources")
    reason_is(cluster, unlimited, "Priority")
    reason_is(cluster, too_long, "Priority")
    assert cluster.job(first)["state"] == "running"  # short ran beside it, before big
    opened(cluster, "ga")  # n0 frees at last: big goes first, the small ones after it
    for job in (big, unlimited, too_long):
        cluster.wait_job(job, lambda j: j["state"] == "completed", "completed")
    assert cluster.job(big)["node"] == "n0"
    assert claimed_at(cluster, big) < min(claimed_at(cluster, unlimited),
                                          claimed_at(cluster, too_long))
    assert claimed_at(cluster, short) < claimed_at(cluster, big)
    opened(cluster, "gb")
    cluster.wait_job(whole, lambda j: j["state"] == "completed", "completed")


def test_after_aftercorr_and_whole_arrays_across_nodes(cluster: Cluster) -> None:
    cluster.agents("n0", "n1")
    # element 0 completes at once; element 1 fails once its gate opens
    arr = cluster.submit("sh", "-c", 'if [ "$TETHER_ARRAY_TASK_ID" = 1 ]; then '
                         + gate("g1") + "; exit 3; fi", opts=("--array", "0-1"))
    corr = cluster.submit("true", opts=("--array", "0-1", "--dependency", f"aftercorr:{arr}"))
    all_ok = cluster.submit("true", opts=("--dependency", f"afterok:{arr}"))
    all_notok = cluster.submit("true", opts=("--dependency", f"afternotok:{arr}_*"))
    started = cluster.submit("true", opts=("--dependency", f"after:{arr}_1"))
    assert shown(cluster, all_ok)["dependency"] == [f"afterok:{arr}_*"]
    assert shown(cluster, started)["dependency"] == [f"after:{arr + 1}"]
    # element 0 of corr waits for element 0 of arr only; after: once element 1 started
    cluster.wait_job(corr, lambda j: j["state"] == "completed", "aftercorr's element 0")
    cluster.wait_job(started, lambda j: j["state"] == "completed", "after")
    reason_is(cluster, corr + 1, "Dependency")
    reason_is(cluster, all_ok, "Dependency")
    reason_is(cluster, all_notok, "Dependency")  # one element completed: not yet decided
    opened(cluster, "g1")
    cluster.wait_job(arr + 1, lambda j: j["state"] == "failed", "element 1 failed")
    for job in (corr + 1, all_ok):
        row = cluster.wait_job(job, lambda j: j["state"] == "cancelled", "never satisfied")
        assert row["reason"].startswith("DependencyNeverSatisfied"), row["reason"]
    cluster.wait_job(all_notok, lambda j: j["state"] == "completed", "afternotok")


def test_singleton_across_nodes(cluster: Cluster) -> None:
    cluster.agents("n0", "n1")
    one = cluster.submit("sh", "-c", gate("gs"), opts=("--name", "solo"), node="n0")
    running(cluster, one)
    two = cluster.submit("true", opts=("--name", "solo", "--dependency", "singleton"),
                         node="n1")
    three = cluster.submit("true", opts=("--name", "solo", "--dependency", "singleton"))
    other = cluster.submit("true", opts=("--name", "other", "--dependency", "singleton"))
    cluster.wait_job(other, lambda j: j["state"] == "completed", "another name runs")
    assert reason_is(cluster, two, "Dependency")["dependency"] == ["singleton"]
    reason_is(cluster, three, "Dependency")
    opened(cluster, "gs")
    for job in (one, two, three):
        cluster.wait_job(job, lambda j: j["state"] == "completed", "completed")
    ends = {j: cluster.attempts(j)[-1] for j in (one, two, three)}
    assert ends[one]["ended_at"] <= ends[two]["claimed_at"]  # one at a time, in order
    assert ends[two]["ended_at"] <= ends[three]["claimed_at"]


def test_a_version_2_cluster_is_upgraded_in_place(pg: ScratchPostgres, make_node: Any) -> None:
    """``cluster init`` takes a database of schema version 2, with its queued jobs (their
    dependencies as version 2 wrote them), to version 3; the agents then run them."""
    cluster = Cluster(pg, make_node, init=False)
    try:
        cluster.sql(META)
        cluster.sql(MIGRATIONS[1])
        cluster.sql(MIGRATIONS[2])
        cluster.sql("INSERT INTO tether_meta VALUES ('schema_version', '2')")
        before = cluster.put("true")
        after = cluster.put("true")
        cluster.sql("UPDATE tether_jobs SET dependency = %s WHERE id = %s",
                    Jsonb([["afterok", before]]), after)
        out = cluster.admin("init", "--heartbeat-timeout", str(TIMEOUT), "--fence-margin",
                            str(MARGIN), "--root-jobs", "allow", "--fairshare-half-life",
                            "1-0").stdout
        assert "version 3" in out and "fair-share half-life 86400s" in out, out
        cluster.agents("n0")
        for job in (before, after):
            cluster.wait_job(job, lambda j: j["state"] == "completed", "completed")
        assert claimed_at(cluster, before) < claimed_at(cluster, after)
        usage = cluster.sql("SELECT uid, cpu_seconds FROM tether_usage")
        assert [u["uid"] for u in usage] == [0] and usage[0]["cpu_seconds"] > 0
    finally:
        cluster.cleanup()


def node_login(cluster: Cluster, name: str, cpus: int) -> Any:
    """Node ``name``'s own login, registered and up (no agent: the test is the node)."""
    path = os.path.join(cluster.work, f"{name}.dsn")
    cluster.add_node(name, path)
    cluster.nodes[name] = cluster.make_node()  # for node_dsn's path and the cleanup
    os.rename(path, os.path.join(cluster.nodes[name].dir, "cluster.dsn"))
    conn = psycopg.connect(node_dsn(cluster, name), autocommit=True, row_factory=dict_row)
    conn.execute("SELECT tether_register(%s, 'h', %s, %s, 0, 1000, 'v', 's', false)",
                 (name, f"/s/{name}", cpus))
    conn.execute("SELECT tether_mark_up('s')")
    return conn


def test_concurrent_claims_never_plan_the_same_cpus_twice(cluster: Cluster) -> None:
    """Two nodes claiming at once, over and over: each job is claimed once, no node is given
    more than it has, and an array's %MAX holds across them (each plan sees the claims
    committed before it)."""
    conns = {name: node_login(cluster, name, 4) for name in ("n0", "n1")}
    elements = [cluster.put("true") for _ in range(10)]  # an array of 10, %3
    cluster.sql("UPDATE tether_jobs SET array_id = %s, array_index = id - %s, array_max = 3 "
                "WHERE id = ANY(%s)", elements[0], elements[0], elements)
    jobs = [cluster.put("true") for _ in range(30)]
    got: dict[str, list[int]] = {"n0": [], "n1": []}
    together = threading.Barrier(2)

    def claim(name: str) -> None:
        for _ in range(20):
            together.wait(10)  # each round, both at once
            conns[name].execute("SELECT tether_heartbeat('s')")
            free = 4 - len(got[name])
            rows = conns[name].execute("SELECT tether_claim('s', %s, 0, 1000) AS c",
                                       (free,)).fetchall()
            got[name] += [r["c"]["id"] for r in rows]

    threads = [threading.Thread(target=claim, args=(name,)) for name in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for conn in conns.values():
        conn.close()
    assert len(got["n0"]) == len(got["n1"]) == 4, got
    assert len(set(got["n0"]) | set(got["n1"])) == 8
    rows = cluster.sql("SELECT id, node, attempt FROM tether_jobs WHERE state = 'starting'")
    assert sorted((r["id"], r["node"]) for r in rows) == sorted(
        [(j, "n0") for j in got["n0"]] + [(j, "n1") for j in got["n1"]])
    assert {r["attempt"] for r in rows} == {1}
    # in order (one user: the oldest first), the array's throttle counted across both nodes
    assert sorted(got["n0"] + got["n1"]) == elements[:3] + jobs[:5]
    waiting = cluster.sql("SELECT id, pending_reason FROM tether_jobs WHERE state = 'pending'")
    assert {r["pending_reason"] for r in waiting if r["id"] in elements} == {
        "JobArrayTaskLimit"}
    assert {r["pending_reason"] for r in waiting if r["id"] in jobs} <= {"Resources",
                                                                         "Priority"}
