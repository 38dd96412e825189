"""The cluster database as the people's commands see it (I/O: psycopg 3 on PostgreSQL).

``connect`` opens one autocommit connection with every wait bounded: the connect itself
(``connect_timeout``), each statement (``statement_timeout``), each lock (``lock_timeout``) and
any transaction left idle by a stopped client (``idle_in_transaction_session_timeout``, so a
SIGSTOPped agent cannot hold row locks that keep its node from being declared down).
Transactions are explicit (``with conn.transaction()``).

Only ``tether cluster init`` creates or changes the schema; everything else checks its version.
The agent's side of the database (claims, heartbeats, results) is in ``agent/cluster_db.py``.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from tether.shared.cluster_sql import (
    ACTIVE,
    CHANNEL_JOB,
    CHANNEL_QUEUE,
    DEFAULT_HEARTBEAT_TIMEOUT,
    FINAL,
    INIT_LOCK,
    JOB_COLUMNS,
    META,
    MIGRATIONS,
    SCHEMA_VERSION,
    SchemaError,
    check_version,
    demand,
    never_fits,
    node_state,
    public_job,
)
from tether.shared.errors import NotFound, ResourceError, StateError, TetherError

Conn = psycopg.Connection[dict[str, Any]]

#: Bounds on every wait, in milliseconds (see the module docstring).
STATEMENT_TIMEOUT_MS = 10_000
LOCK_TIMEOUT_MS = 5_000
IDLE_IN_TRANSACTION_MS = 10_000
CONNECT_TIMEOUT_S = 5


class ClusterError(TetherError):
    """The cluster database refused, or holds no usable schema."""

    code = "cluster"


class ClusterUnreachable(ClusterError):
    code = "unreachable"


def connect(dsn: str, *, application: str = "tether") -> Conn:
    options = (f"-c statement_timeout={STATEMENT_TIMEOUT_MS} -c lock_timeout={LOCK_TIMEOUT_MS} "
               f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}")
    try:
        conn: Conn = psycopg.connect(dsn, autocommit=True, row_factory=dict_row,
                                     connect_timeout=CONNECT_TIMEOUT_S, options=options,
                                     application_name=application[:63])
    except psycopg.ProgrammingError as exc:  # a malformed DSN
        raise ClusterError(f"bad cluster DSN: {one_line(exc)}") from None
    except psycopg.Error as exc:
        raise ClusterUnreachable(f"cannot reach the cluster database: {one_line(exc)}") from None
    return conn


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def schema_version(conn: Conn) -> int | None:
    row = conn.execute("SELECT to_regclass('tether_meta') IS NOT NULL AS present").fetchone()
    if row is None or not row["present"]:
        return None
    row = conn.execute("SELECT value FROM tether_meta WHERE key = 'schema_version'").fetchone()
    return None if row is None else int(row["value"])


def open_checked(dsn: str, application: str = "tether") -> Conn:
    """A connection to a database whose schema this build speaks."""
    conn = connect(dsn, application=application)
    try:
        check_version(schema_version(conn))
    except SchemaError as exc:
        conn.close()
        raise ClusterError(str(exc)) from None
    except psycopg.Error as exc:
        conn.close()
        raise ClusterUnreachable(f"the cluster database failed: {one_line(exc)}") from None
    return conn


def heartbeat_timeout(conn: Conn) -> float:
    row = conn.execute("SELECT value FROM tether_meta WHERE key = 'heartbeat_timeout'").fetchone()
    return DEFAULT_HEARTBEAT_TIMEOUT if row is None else float(row["value"])


def init(conn: Conn, timeout: float | None) -> dict[str, Any]:
    """Create or upgrade the schema (idempotent); set ``heartbeat_timeout`` if given."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (INIT_LOCK,))
        conn.execute(META)
        found = schema_version(conn) or 0
        if found > SCHEMA_VERSION:
            raise ClusterError(f"the database's tether schema is version {found}, newer than "
                               f"this tether's {SCHEMA_VERSION}: upgrade tether")
        for version in range(found + 1, SCHEMA_VERSION + 1):
            conn.execute(MIGRATIONS[version])
        conn.execute("INSERT INTO tether_meta VALUES ('schema_version', %s) ON CONFLICT (key) "
                     "DO UPDATE SET value = EXCLUDED.value", (str(SCHEMA_VERSION),))
        if timeout is not None:
            conn.execute("INSERT INTO tether_meta VALUES ('heartbeat_timeout', %s) ON CONFLICT "
                         "(key) DO UPDATE SET value = EXCLUDED.value", (repr(float(timeout)),))
        else:
            conn.execute("INSERT INTO tether_meta VALUES ('heartbeat_timeout', %s) ON CONFLICT "
                         "DO NOTHING", (repr(DEFAULT_HEARTBEAT_TIMEOUT),))
        hb = heartbeat_timeout(conn)
    return {"schema_version": SCHEMA_VERSION, "previous_version": found or None,
            "heartbeat_timeout": hb}


# ---- jobs -----------------------------------------------------------------------------------


def submit(conn: Conn, fields: dict[str, Any], output: str | None,
           error: str | None) -> dict[str, Any]:
    """Queue one job. ``output``/``error`` may hold ``%j`` (the id the insert gives)."""
    need = demand(fields)
    with conn.transaction():
        sizes = conn.execute("SELECT cpus, gpus, memory_mb FROM tether_nodes").fetchall()
        if sizes:
            reasons = [never_fits(need, (n["cpus"], n["gpus"], n["memory_mb"])) for n in sizes]
            if all(reasons):
                per = (f" ({fields['ntasks']} tasks x {fields['cpus_per_task']} CPUs)"
                       if fields["ntasks"] > 1 else "")
                raise ResourceError(f"job can never run on any node of the cluster: the "
                                    f"largest {reasons[0]}{per}")
        row = conn.execute(
            "INSERT INTO tether_jobs (name, command, state, cpus_per_task, ntasks, gpus_req, "
            "memory_mb, output, error, workdir, env, submitted_at, pmi, username, uid, gid, "
            "requeue) VALUES (%(name)s, %(command)s, 'pending', %(cpus_per_task)s, %(ntasks)s, "
            "%(gpus_req)s, %(memory_mb)s, '', '', %(workdir)s, %(env)s, %(submitted_at)s, "
            "%(pmi)s, %(username)s, %(uid)s, %(gid)s, %(requeue)s) RETURNING id",
            dict(fields, command=Jsonb(fields["command"]), env=Jsonb(fields["env"]))).fetchone()
        assert row is not None
        job_id = row["id"]
        out = (output or f"{fields['workdir']}/tether-%j.out").replace("%j", str(job_id))
        err = (error or out).replace("%j", str(job_id))
        conn.execute("UPDATE tether_jobs SET output = %s, error = %s WHERE id = %s",
                     (out, err, job_id))
        conn.execute("SELECT pg_notify(%s, '')", (CHANNEL_QUEUE,))
    return get_job(conn, job_id)


def get_row(conn: Conn, job_id: int) -> dict[str, Any]:
    row = conn.execute(f"SELECT {JOB_COLUMNS} FROM tether_jobs WHERE id = %s",
                       (job_id,)).fetchone()
    if row is None:
        raise NotFound(f"no job {job_id}")
    return row


def get_job(conn: Conn, job_id: int) -> dict[str, Any]:
    return public_job(get_row(conn, job_id))


def list_jobs(conn: Conn, after: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
    rows = conn.execute(f"SELECT {JOB_COLUMNS} FROM tether_jobs WHERE id > %s ORDER BY id "
                        "LIMIT %s", (after, limit)).fetchall()
    return [public_job(r) for r in rows]


def cancel(conn: Conn, job_id: int) -> dict[str, Any]:
    """A queued job ends here; a running one is asked of its node (which reports the end)."""
    with conn.transaction():
        row = conn.execute("SELECT state FROM tether_jobs WHERE id = %s FOR UPDATE",
                           (job_id,)).fetchone()
        if row is None:
            raise NotFound(f"no job {job_id}")
        if row["state"] in FINAL:
            raise StateError(f"job {job_id} has already ended ({row['state']})")
        if row["state"] == "pending":
            conn.execute("UPDATE tether_jobs SET state = 'cancelled', reason = 'cancelled while "
                         "pending', ended_at = to_char(clock_timestamp() AT TIME ZONE 'UTC', "
                         "'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') WHERE id = %s", (job_id,))
        else:
            conn.execute("UPDATE tether_jobs SET cancel_requested = true WHERE id = %s",
                         (job_id,))
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL_JOB, str(job_id)))
    return get_job(conn, job_id)


# ---- nodes ----------------------------------------------------------------------------------


def list_nodes(conn: Conn) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT n.*, extract(epoch FROM clock_timestamp() - n.heartbeat) AS age, "
        "to_char(n.heartbeat AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS hb, "
        "coalesce(sum(j.cpus_per_task * j.ntasks), 0) AS cpus_alloc, "
        "coalesce(sum(j.gpus_req), 0) AS gpus_alloc, "
        "coalesce(sum(j.memory_mb), 0) AS memory_alloc, count(j.id) AS running "
        "FROM tether_nodes n LEFT JOIN tether_jobs j ON j.node = n.name "
        "AND j.state = ANY(%s) GROUP BY n.name ORDER BY n.name", (list(ACTIVE),)).fetchall()
    return [{
        "name": r["name"], "state": node_state(r["state"], r["drain"]), "host": r["host"],
        "cpus": {"total": r["cpus"], "allocated": int(r["cpus_alloc"])},
        "gpus": {"total": r["gpus"], "allocated": int(r["gpus_alloc"])},
        "memory_mb": {"total": r["memory_mb"], "allocated": int(r["memory_alloc"])},
        "running": int(r["running"]), "heartbeat": r["hb"],
        "heartbeat_age": round(float(r["age"]), 3), "version": r["version"],
        "reason": r["reason"], "state_dir": r["state_dir"],
    } for r in rows]


def set_drain(conn: Conn, node: str, drain: bool) -> None:
    with conn.transaction():
        row = conn.execute("UPDATE tether_nodes SET drain = %s WHERE name = %s RETURNING name",
                           (drain, node)).fetchone()
        if row is None:
            raise NotFound(f"no node {node!r} in the cluster")
        if not drain:
            conn.execute("SELECT pg_notify(%s, '')", (CHANNEL_QUEUE,))


def where(conn: Conn, job_id: int) -> dict[str, Any]:
    """Where a job's current attempt runs: node, host, state dir and the node's local job id."""
    row = conn.execute(
        "SELECT j.state, j.node, j.local_job, j.attempt, n.host, n.state_dir FROM tether_jobs j "
        "LEFT JOIN tether_nodes n ON n.name = j.node WHERE j.id = %s", (job_id,)).fetchone()
    if row is None:
        raise NotFound(f"no job {job_id}")
    return row


def listen(conn: Conn, *channels: str) -> None:
    for channel in channels:
        conn.execute(f"LISTEN {channel}")  # channel names are our constants, never input
