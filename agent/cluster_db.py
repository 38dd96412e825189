"""The agent's side of the cluster database (I/O): join, heartbeat, claim, report, declare down.

Every function is one short transaction on the agent's own autocommit connection. Nothing here
waits on a lock held by another agent: claims and node reaping take rows ``FOR UPDATE SKIP
LOCKED``; the rest lock one row the caller owns. A node's clock never matters: heartbeat ages
are measured with the database server's ``clock_timestamp()``.

Why a result cannot be recorded twice or for the wrong attempt: ``report`` locks the job's row
and writes the result only if the row still names this node, this attempt and an active state,
in the same transaction. Declaring a node down moves its jobs out of those states in one
transaction, so a late result from that node finds the job pending, elsewhere or final, and is
refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from psycopg.types.json import Jsonb

from tether.shared.cluster_db import ClusterError, Conn
from tether.shared.cluster_sql import (
    ACTIVE,
    CHANNEL_JOB,
    CHANNEL_QUEUE,
    JOB_COLUMNS,
    demand,
    never_fits,
)

#: Queued jobs looked at per claim (the oldest first).
CLAIM_WINDOW = 64

_NOW_TEXT = "to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    host: str
    state_dir: str
    cpus: int
    gpus: int
    memory_mb: int
    version: str
    session: str


@dataclass(frozen=True, slots=True)
class Claimed:
    job: int
    attempt: int
    local_job: int


def register(conn: Conn, info: NodeInfo, timeout: float) -> bool:
    """Join (or rejoin) the cluster. True if the node had been declared down meanwhile (it
    stays ``down`` until ``mark_up``, after the caller has reconciled)."""
    with conn.transaction():
        row = conn.execute(
            "SELECT state, host, state_dir, extract(epoch FROM clock_timestamp() - heartbeat) "
            "AS age FROM tether_nodes WHERE name = %s FOR UPDATE", (info.name,)).fetchone()
        values = {"name": info.name, "host": info.host, "state_dir": info.state_dir,
                  "cpus": info.cpus, "gpus": info.gpus, "memory_mb": info.memory_mb,
                  "version": info.version, "session": info.session}
        if row is None:
            conn.execute(
                "INSERT INTO tether_nodes (name, host, state_dir, state, cpus, gpus, memory_mb, "
                "version, session, heartbeat, registered_at) VALUES (%(name)s, %(host)s, "
                "%(state_dir)s, 'up', %(cpus)s, %(gpus)s, %(memory_mb)s, %(version)s, "
                "%(session)s, clock_timestamp(), clock_timestamp())", values)
            return False
        if (row["state"] == "up" and float(row["age"]) < timeout
                and (row["host"], row["state_dir"]) != (info.host, info.state_dir)):
            raise ClusterError(
                f"node {info.name!r} is up with another agent (host {row['host']}, state dir "
                f"{row['state_dir']}, heartbeat {float(row['age']):.1f}s ago): pick another "
                "--node")
        conn.execute(
            "UPDATE tether_nodes SET host = %(host)s, state_dir = %(state_dir)s, cpus = %(cpus)s,"
            " gpus = %(gpus)s, memory_mb = %(memory_mb)s, version = %(version)s, session = "
            "%(session)s, heartbeat = clock_timestamp(), registered_at = clock_timestamp() "
            "WHERE name = %(name)s", values)
        return bool(row["state"] == "down")


def mark_up(conn: Conn, info: NodeInfo) -> None:
    with conn.transaction():
        conn.execute("UPDATE tether_nodes SET state = 'up', reason = NULL, heartbeat = "
                     "clock_timestamp() WHERE name = %s AND session = %s",
                     (info.name, info.session))
        conn.execute("SELECT pg_notify(%s, '')", (CHANNEL_QUEUE,))


def heartbeat(conn: Conn, info: NodeInfo) -> str:
    """``up``, ``draining``, ``down`` (declared down meanwhile) or ``taken`` (another agent
    registered this name since)."""
    row = conn.execute(
        "UPDATE tether_nodes SET heartbeat = clock_timestamp() WHERE name = %s AND session = %s "
        "AND state = 'up' RETURNING drain", (info.name, info.session)).fetchone()
    if row is not None:
        return "draining" if row["drain"] else "up"
    row = conn.execute("SELECT state, session FROM tether_nodes WHERE name = %s",
                       (info.name,)).fetchone()
    if row is None or row["session"] != info.session:
        return "taken"
    return "down"


def reap(conn: Conn, me: str, timeout: float) -> list[dict[str, Any]]:
    """Declare down every up node whose heartbeat is older than ``timeout`` (never ``me``): one
    transaction per node, which requeues its active jobs (attempt + 1 at their next claim) or
    fails those submitted with ``--no-requeue``. Returns what it did, per node."""
    done: list[dict[str, Any]] = []
    while True:
        with conn.transaction():
            node = conn.execute(
                "SELECT name, extract(epoch FROM clock_timestamp() - heartbeat) AS age FROM "
                "tether_nodes WHERE state = 'up' AND name <> %s AND heartbeat < "
                "clock_timestamp() - make_interval(secs => %s) ORDER BY name LIMIT 1 "
                "FOR UPDATE SKIP LOCKED", (me, timeout)).fetchone()
            if node is None:
                return done
            why = (f"node {node['name']} missed its heartbeats (last {float(node['age']):.1f}s "
                   f"ago, timeout {timeout:g}s); declared down by {me}")
            conn.execute("UPDATE tether_nodes SET state = 'down', reason = %s WHERE name = %s",
                         (why, node["name"]))
            jobs = conn.execute(
                "SELECT id, attempt, requeue, cancel_requested FROM tether_jobs WHERE node = %s "
                "AND state = ANY(%s) FOR UPDATE", (node["name"], list(ACTIVE))).fetchall()
            requeued: list[int] = []
            failed: list[int] = []
            for j in jobs:
                if j["cancel_requested"]:
                    state, reason = "cancelled", f"cancelled; {why}"
                elif j["requeue"]:
                    state, reason = "pending", f"requeued after attempt {j['attempt']}: {why}"
                else:
                    state, reason = "failed", f"{why}; not requeued (--no-requeue)"
                (requeued if state == "pending" else failed).append(j["id"])
                conn.execute(
                    "UPDATE tether_jobs SET state = %s, reason = %s, node = CASE WHEN %s = "
                    f"'pending' THEN NULL ELSE node END, ended_at = CASE WHEN %s = 'pending' "
                    f"THEN NULL ELSE {_NOW_TEXT} END WHERE id = %s",
                    (state, reason, state, state, j["id"]))
                conn.execute("UPDATE tether_attempts SET state = 'lost', reason = %s, ended_at = "
                             "clock_timestamp() WHERE job = %s AND attempt = %s",
                             (why, j["id"], j["attempt"]))
                conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL_JOB, str(j["id"])))
            if requeued:
                conn.execute("SELECT pg_notify(%s, '')", (CHANNEL_QUEUE,))
            done.append({"node": node["name"], "requeued": requeued, "failed": failed,
                         "reason": why})


def my_jobs(conn: Conn, me: str) -> list[dict[str, Any]]:
    """The active jobs the database says this node runs."""
    rows = conn.execute(
        "SELECT id, attempt, state, local_job, cancel_requested FROM tether_jobs WHERE node = %s "
        "AND state = ANY(%s)", (me, list(ACTIVE))).fetchall()
    return rows


def claim(conn: Conn, info: NodeInfo, free: tuple[int, int, int], size: tuple[int, int, int],
          take_local: Callable[[dict[str, Any], int], int]) -> list[Claimed] | None:
    """Claim queued jobs that fit ``free``, oldest first (None: this node may not take work).

    A job that could never run on a node of ``size`` is left to other nodes; the first one
    that could but does not fit now ends the claim, so bigger jobs are not overtaken here.
    ``take_local(row, attempt)`` records the job in the node's own store (inside a local
    transaction the caller commits only after this returns) and gives its local id.
    """
    with conn.transaction():
        node = conn.execute("SELECT state, drain, session FROM tether_nodes WHERE name = %s "
                            "FOR SHARE", (info.name,)).fetchone()
        if node is None or node["state"] != "up" or node["session"] != info.session:
            return None
        if node["drain"]:
            return []
        rows = conn.execute(
            f"SELECT {JOB_COLUMNS} FROM tether_jobs WHERE state = 'pending' ORDER BY id "
            "LIMIT %s FOR UPDATE SKIP LOCKED", (CLAIM_WINDOW,)).fetchall()
        left = list(free)
        taken: list[Claimed] = []
        for row in rows:
            need = demand(row)
            if never_fits(need, size):
                continue
            if any(n > f for n, f in zip(need, left, strict=True)):
                break
            left = [f - n for n, f in zip(need, left, strict=True)]
            attempt = int(row["attempt"]) + 1
            local = take_local(row, attempt)
            conn.execute(
                "UPDATE tether_jobs SET state = 'starting', attempt = %s, node = %s, local_job = "
                "%s, reason = NULL, cpus = '[]', gpus = '[]', pids = '[]', supervisor_pid = NULL,"
                " started_at = NULL WHERE id = %s", (attempt, info.name, local, row["id"]))
            conn.execute("INSERT INTO tether_attempts (job, attempt, node, state) VALUES "
                         "(%s, %s, %s, 'starting')", (row["id"], attempt, info.name))
            taken.append(Claimed(row["id"], attempt, local))
        return taken


def set_running(conn: Conn, me: str, job: int, attempt: int, fields: dict[str, Any]) -> None:
    conn.execute(
        "UPDATE tether_jobs SET state = 'running', started_at = %s, cpus = %s, gpus = %s, "
        "pids = %s, supervisor_pid = %s WHERE id = %s AND attempt = %s AND node = %s AND "
        "state = 'starting'",
        (fields["started_at"], Jsonb(fields["cpus"]), Jsonb(fields["gpus"]),
         Jsonb(fields["pids"]), fields["supervisor_pid"], job, attempt, me))
    conn.execute("UPDATE tether_attempts SET state = 'running' WHERE job = %s AND attempt = %s "
                 "AND state = 'starting'", (job, attempt))


def report(conn: Conn, me: str, job: int, attempt: int, result: dict[str, Any]) -> str | None:
    """Record a final result for (job, attempt); None if recorded, else why it was refused."""
    with conn.transaction():
        row = conn.execute("SELECT state, attempt, node FROM tether_jobs WHERE id = %s FOR "
                           "UPDATE", (job,)).fetchone()
        if row is None:
            return f"job {job} is not in the cluster"
        if row["attempt"] != attempt or row["node"] != me or row["state"] not in ACTIVE:
            return (f"job {job} attempt {attempt} is no longer current here (now attempt "
                    f"{row['attempt']}, {row['state']}, node {row['node']})")
        conn.execute(
            "UPDATE tether_jobs SET state = %(state)s, exit_code = %(exit_code)s, signal = "
            "%(signal)s, reason = %(reason)s, started_at = coalesce(%(started_at)s, started_at),"
            " ended_at = %(ended_at)s, pids = %(pids)s, supervisor_pid = coalesce("
            "%(supervisor_pid)s, supervisor_pid), cpus = %(cpus)s, gpus = %(gpus)s WHERE id = "
            "%(id)s",
            dict(result, id=job, pids=Jsonb(result["pids"]), cpus=Jsonb(result["cpus"]),
                 gpus=Jsonb(result["gpus"])))
        conn.execute("UPDATE tether_attempts SET state = %s, reason = %s, ended_at = "
                     "clock_timestamp() WHERE job = %s AND attempt = %s",
                     (result["state"], result["reason"], job, attempt))
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL_JOB, str(job)))
        conn.execute("SELECT pg_notify(%s, '')", (CHANNEL_QUEUE,))
    return None


def requeue_unknown(conn: Conn, me: str, job: int, attempt: int, why: str) -> bool:
    """A claim this node holds in the database but never recorded locally: it never ran here,
    so it goes back to the queue (or ends cancelled if that was asked)."""
    with conn.transaction():
        row = conn.execute(
            "UPDATE tether_jobs SET state = CASE WHEN cancel_requested THEN 'cancelled' ELSE "
            "'pending' END, node = CASE WHEN cancel_requested THEN node ELSE NULL END, reason = "
            f"%s, ended_at = CASE WHEN cancel_requested THEN {_NOW_TEXT} END WHERE id = %s AND "
            "attempt = %s AND node = %s AND state = ANY(%s) RETURNING id",
            (why, job, attempt, me, list(ACTIVE))).fetchone()
        conn.execute("UPDATE tether_attempts SET state = 'lost', reason = %s, ended_at = "
                     "clock_timestamp() WHERE job = %s AND attempt = %s", (why, job, attempt))
        conn.execute("SELECT pg_notify(%s, '')", (CHANNEL_QUEUE,))
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL_JOB, str(job)))
    return row is not None


def leave_if_idle(conn: Conn, info: NodeInfo) -> bool:
    """Set the node ``down`` unless the database says it still runs something."""
    row = conn.execute(
        "UPDATE tether_nodes SET state = 'down', reason = 'its agent stopped while idle' WHERE "
        "name = %s AND session = %s AND NOT EXISTS (SELECT 1 FROM tether_jobs WHERE node = %s "
        "AND state = ANY(%s)) RETURNING name",
        (info.name, info.session, info.name, list(ACTIVE))).fetchone()
    return row is not None
