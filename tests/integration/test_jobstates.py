"""One table of a job's states and moves (shared/jobstates.py): its invariants, and the cluster's
functions allowing each move from exactly the states the table lists, on a real PostgreSQL."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from tests.clusterkit import Cluster, node_dsn
from tether.agent.job import ACTIVE as NODE_ACTIVE
from tether.agent.job import FINAL as NODE_FINAL
from tether.shared import cluster_db
from tether.shared.errors import TetherError
from tether.shared.jobstates import (
    ACTIVE,
    FINAL,
    MOVES,
    PENDING,
    RESULTS,
    STATES,
    Move,
    MoveError,
    after,
    sources,
)


def test_nothing_leaves_a_final_state_and_every_state_is_reachable() -> None:
    for move, (starts, _) in MOVES.items():
        assert not set(starts) & set(FINAL), move
    reached = {PENDING}
    for _ in STATES:
        for move, (starts, to) in MOVES.items():
            for state in list(reached):
                if state in starts:
                    reached |= set(RESULTS) if move is Move.END else {to or state}
    assert reached == set(STATES)
    assert after(Move.CLAIM, "pending") == "starting"
    assert after(Move.END, "running", "timeout") == "timeout"
    with pytest.raises(MoveError, match="can't requeue a job that is completed"):
        after(Move.REQUEUE, "completed")
    with pytest.raises(MoveError):
        after(Move.END, "running", "node_fail")  # the cluster's word, never a step's
    assert (NODE_ACTIVE, NODE_FINAL) == (ACTIVE, RESULTS)  # a node's jobs: the same table


@pytest.fixture
def n0(cluster: Cluster) -> Iterator[psycopg.Connection[Any]]:
    """Node n0's own login, registered and up (no agent: the test is the node)."""
    path = os.path.join(cluster.work, "n0.dsn")
    cluster.add_node("n0", path)
    cluster.nodes["n0"] = cluster.make_node()  # for node_dsn's path and the cleanup
    os.rename(path, os.path.join(cluster.nodes["n0"].dir, "cluster.dsn"))
    with psycopg.connect(node_dsn(cluster, "n0"), autocommit=True, row_factory=dict_row) as conn:
        conn.execute("SELECT tether_register('n0', 'h', '/s', 64, 0, 1000, 'v', 's', false)")
        conn.execute("SELECT tether_mark_up('s')")
        yield conn


def in_state(cluster: Cluster, state: str) -> int:
    """A job of n0's attempt 1 in ``state`` (written by the owner, as any row may be)."""
    job = cluster.put("true")
    cluster.sql("UPDATE tether_jobs SET state = %s, node = CASE WHEN %s = 'pending' THEN NULL "
                "ELSE 'n0' END, attempt = 1, local_job = 1 WHERE id = %s", state, state, job)
    return job


def check(cluster: Cluster, move: Move, attempt: Callable[[int], bool]) -> None:
    """``attempt(job)`` says whether the function moved it; it must iff the table allows."""
    for state in STATES:
        job = in_state(cluster, state)
        moved = attempt(job)
        assert moved == (state in sources(move)), (move, state, cluster.job(job)["state"])


def test_the_cluster_functions_follow_the_table(cluster: Cluster,
                                                n0: psycopg.Connection[Any]) -> None:
    def call(query: str, *args: Any) -> Any:
        try:
            return cluster_db.call(n0, query, args)
        except TetherError as exc:
            return exc

    check(cluster, Move.START, lambda j: call(
        "SELECT tether_set_running(%s, 1, 1, 'x', '[]', '[]', '[]', 1)", j) is True)
    check(cluster, Move.END, lambda j: call(
        "SELECT tether_report(%s, 1, %s)", j, Jsonb({"state": "completed"})) is None)
    check(cluster, Move.REQUEUE, lambda j: call(
        "SELECT tether_requeue_unknown(%s, 1, 'test')", j) is True)
    check(cluster, Move.HOLD, lambda j: not isinstance(
        call("SELECT tether_hold(%s, 0, true)", j), TetherError))
    check(cluster, Move.CANCEL, lambda j: call("SELECT tether_cancel(%s, 0)", j) == "cancelled")
    check(cluster, Move.ASK_CANCEL, lambda j: call("SELECT tether_cancel(%s, 0)", j) in ACTIVE)

    cluster.sql("UPDATE tether_jobs SET state = 'completed' WHERE state = 'pending'")  # the above
    claimed = [in_state(cluster, s) for s in STATES]
    got = n0.execute("SELECT tether_claim('s', 64, 0, 1000) AS c").fetchall()
    assert [r["c"]["id"] for r in got] == [claimed[STATES.index(PENDING)]]
    assert cluster.job(claimed[0])["state"] == after(Move.CLAIM, PENDING)

    def lose(job: int) -> bool:
        cluster.sql("UPDATE tether_jobs SET requeue = false WHERE id = %s", job)
        conn = cluster_db.connect(cluster.dsn)  # the administrator: n0 is confirmed dead
        try:
            return job in cluster_db.confirm_dead(conn, "n0")["ended"]
        finally:
            conn.close()
    check(cluster, Move.LOSE, lose)
