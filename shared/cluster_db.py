"""The cluster database as the people's commands see it (I/O: psycopg 3 on PostgreSQL).

``connect`` opens one autocommit connection with every wait bounded: the connect itself
(``connect_timeout``), each statement (``statement_timeout``), each lock (``lock_timeout``) and
any transaction left idle by a stopped client (``idle_in_transaction_session_timeout``, so a
SIGSTOPped agent cannot hold row locks that keep its node from being declared down).
Transactions are explicit (``with conn.transaction()``).

Who connects: the administrator (``tether cluster init`` and ``add-node``: the tables' owner)
and the agents, each as its own node's role (cluster_funcs.py says what a node may do). People
never do: their commands reach the database through an agent, which authenticated them by
the kernel. Only ``init`` creates or changes the schema; everything else checks its version.
The agent's side of the database (claims, heartbeats, results) is in ``agent/cluster_db.py``.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from tether.shared import cluster_funcs, stamps
from tether.shared.cluster_sched import DEFAULT_HALF_LIFE
from tether.shared.cluster_sql import (
    ACTIVE,
    DEFAULT_FENCE_MARGIN,
    DEFAULT_HEARTBEAT_TIMEOUT,
    FINAL,
    INIT_LOCK,
    JOB_COLUMNS,
    META,
    MIGRATIONS,
    SCHEMA_VERSION,
    SchemaError,
    check_version,
    node_state,
    public_job,
)
from tether.shared.errors import (
    BadRequest,
    Busy,
    NotFound,
    PermissionDenied,
    ResourceError,
    StateError,
    TetherError,
)

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
    except psycopg.errors.InsufficientPrivilege:
        user = conn.info.user
        conn.close()
        raise ClusterError(f"database role {user} may not read tether's tables: it is no "
                           "tether node (an administrator runs `tether cluster add-node NAME`)"
                           ) from None
    except psycopg.Error as exc:
        conn.close()
        raise ClusterUnreachable(f"the cluster database failed: {one_line(exc)}") from None
    return conn


def heartbeat_timeout(conn: Conn) -> float:
    row = conn.execute("SELECT value FROM tether_meta WHERE key = 'heartbeat_timeout'").fetchone()
    return DEFAULT_HEARTBEAT_TIMEOUT if row is None else float(row["value"])


def init(conn: Conn, timeout: float | None, root_jobs: bool | None = None,
         fence_margin: float | None = None, requeue: bool | None = None,
         half_life: float | None = None) -> dict[str, Any]:
    """Create or upgrade the schema, its functions and privileges (idempotent); set the
    settings given. Run by the administrator: the role that owns the tables."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (INIT_LOCK,))
        schema = conn.execute("SELECT current_schema() AS s").fetchone()
        if schema is None or schema["s"] is None:
            raise ClusterError("the connection has no current schema to create tables in")
        loose = conn.execute("SELECT has_schema_privilege('public', current_schema(), 'CREATE')"
                             " AS loose").fetchone()
        if loose is not None and loose["loose"]:
            raise ClusterError(
                f"every role may create objects in schema {schema['s']!r}, where tether's "
                "functions would run as its owner: REVOKE CREATE ON SCHEMA "
                f"{schema['s']} FROM PUBLIC first")
        conn.execute(META)
        found = schema_version(conn) or 0
        if found > SCHEMA_VERSION:
            raise ClusterError(f"the database's tether schema is version {found}, newer than "
                               f"this tether's {SCHEMA_VERSION}: upgrade tether")
        for version in range(found + 1, SCHEMA_VERSION + 1):
            conn.execute(MIGRATIONS[version])
        set_meta(conn, "schema_version", str(SCHEMA_VERSION))
        set_meta(conn, "heartbeat_timeout",
                 repr(float(timeout if timeout is not None else DEFAULT_HEARTBEAT_TIMEOUT)),
                 replace=timeout is not None)
        set_meta(conn, "allow_root_jobs", "true" if root_jobs else "false",
                 replace=root_jobs is not None)
        set_meta(conn, "fence_margin",
                 repr(float(fence_margin if fence_margin is not None else
                            DEFAULT_FENCE_MARGIN)), replace=fence_margin is not None)
        set_meta(conn, "requeue", "false" if requeue is False else "true",
                 replace=requeue is not None)
        set_meta(conn, "fairshare_half_life",
                 repr(float(half_life if half_life is not None else DEFAULT_HALF_LIFE)),
                 replace=half_life is not None)
        group = node_group(conn)
        set_meta(conn, "node_group", group, replace=False)
        conn.execute(sql.SQL("DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = "
                             "{name}) THEN CREATE ROLE {role} NOLOGIN; END IF; END $$").format(
                                 name=sql.Literal(group), role=sql.Identifier(group)))
        conn.execute(cluster_funcs.functions_sql(
            sql.Identifier(schema["s"]).as_string(conn)))
        for statement in cluster_funcs.privileges_sql(sql.Identifier(group).as_string(conn)):
            conn.execute(statement)
        hb = heartbeat_timeout(conn)
        meta = {r["key"]: r["value"] for r in conn.execute("SELECT * FROM tether_meta")}
    return {"schema_version": SCHEMA_VERSION, "previous_version": found or None,
            "heartbeat_timeout": hb, "fence_margin": float(meta["fence_margin"]),
            "node_group": group, "allow_root_jobs": meta["allow_root_jobs"] == "true",
            "requeue": meta["requeue"] == "true",
            "fairshare_half_life": float(meta["fairshare_half_life"])}


def set_meta(conn: Conn, key: str, value: str, replace: bool = True) -> None:
    conn.execute("INSERT INTO tether_meta VALUES (%s, %s) ON CONFLICT (key) DO "
                 + ("UPDATE SET value = EXCLUDED.value" if replace else "NOTHING"),
                 (key, value))


def node_group(conn: Conn) -> str:
    """The role every node's login is a member of: one per database (roles are the server's,
    databases are clusters: two clusters on one server never share it)."""
    row = conn.execute("SELECT value FROM tether_meta WHERE key = 'node_group'").fetchone()
    if row is not None:
        return str(row["value"])
    db = conn.execute("SELECT current_database() AS d").fetchone()
    assert db is not None
    return ("tether_node_" + str(db["d"]))[:63]


#: what a node name may be (it names a role and appears in paths: %N)
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")


def add_node(conn: Conn, name: str, role: str | None = None,
             host: str | None = None) -> dict[str, Any]:
    """Create (or give a new password to) the login role of node ``name``: returns the
    connection string that node's agent needs (its role and password: for a root-only file).

    The password is sent to the server already hashed (SCRAM), so it appears in no server log
    or statement; it is shown once, here, and kept nowhere else."""
    if not NODE_NAME.match(name):
        raise ClusterError(f"bad node name {name!r}: letters, digits, '.', '_' and '-', at most "
                           "63, starting with a letter or digit")
    role = role or f"tether_{name}"
    if not NODE_NAME.match(role):
        raise ClusterError(f"bad role name {role!r}")
    password = secrets.token_urlsafe(24)
    verifier = conn.pgconn.encrypt_password(password.encode(), role.encode(),
                                            b"scram-sha-256").decode()
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (INIT_LOCK,))
        try:
            check_version(schema_version(conn))
        except SchemaError as exc:
            raise ClusterError(str(exc)) from None
        group = node_group(conn)
        other = conn.execute("SELECT name FROM tether_nodes WHERE role = %s AND name <> %s",
                             (role, name)).fetchone()
        if other is not None:
            raise ClusterError(f"role {role!r} is node {other['name']!r}'s already")
        exists = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = %s",
                              (role,)).fetchone()
        if exists is not None and exists["rolsuper"]:
            raise ClusterError(f"role {role!r} is a superuser: a node's role must not be")
        verb = "ALTER" if exists is not None else "CREATE"
        conn.execute(sql.SQL(verb + " ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE "
                             "NOREPLICATION NOBYPASSRLS PASSWORD {}").format(
                                 sql.Identifier(role), sql.Literal(verifier)))
        conn.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(group),
                                                      sql.Identifier(role)))
        conn.execute(
            "INSERT INTO tether_nodes (name, host, state_dir, state, cpus, gpus, memory_mb, "
            "version, session, heartbeat, registered_at, reason, role) VALUES (%s, '', '', "
            "'down', 0, 0, 0, '', '', clock_timestamp(), clock_timestamp(), 'never joined', %s)"
            " ON CONFLICT (name) DO UPDATE SET role = EXCLUDED.role", (name, role))
    info = conn.info
    dsn = make_conninfo(host=host or info.host, port=str(info.port), dbname=info.dbname,
                        user=role, password=password)
    return {"node": name, "role": role, "dsn": dsn}


def confirm_dead(conn: Conn, node: str) -> dict[str, Any]:
    """The administrator knows ``node`` is off: it goes down now and its active jobs are
    requeued (or end node_fail, or cancelled), as ``tether_reap`` would after the timeout."""
    why = f"node {node} was confirmed dead by the administrator"
    requeued: list[int] = []
    ended: list[int] = []
    with conn.transaction():
        row = conn.execute("SELECT state FROM tether_nodes WHERE name = %s FOR UPDATE",
                           (node,)).fetchone()
        if row is None:
            raise NotFound(f"no node {node!r} in the cluster")
        conn.execute("UPDATE tether_nodes SET state = 'down', reason = %s WHERE name = %s",
                     (why, node))
        jobs = conn.execute("SELECT id, attempt FROM tether_jobs WHERE node = %s AND state = "
                            "ANY(%s) ORDER BY id FOR UPDATE", (node, list(ACTIVE))).fetchall()
        for j in jobs:
            lost = conn.execute("SELECT v_state FROM tether_lose(%s, %s, %s)",
                                (j["id"], j["attempt"], why)).fetchone()
            assert lost is not None
            (requeued if lost["v_state"] == "pending" else ended).append(int(j["id"]))
    return {"node": node, "requeued": requeued, "ended": ended, "reason": why}


# ---- jobs -----------------------------------------------------------------------------------


def call(conn: Conn, query: str, params: tuple[Any, ...] = ()) -> Any:
    """One call of a tether function: its first column, or its errors as tether's."""
    try:
        row = conn.execute(query, params).fetchone()
    except psycopg.Error as exc:
        raise translated(exc) from None
    return None if row is None else next(iter(row.values()))


def translated(exc: psycopg.Error) -> Exception:
    """A function's own refusal (SQLSTATE TTxxx) as the TetherError it means; the rest as is."""
    code = cluster_funcs.ERROR_CODES.get(exc.sqlstate or "")
    if code is None:
        return exc
    message = exc.diag.message_primary or one_line(exc)
    if code == "not_up":
        return NodeNotUp(message)
    return {"bad_request": BadRequest, "permission_denied": PermissionDenied,
            "not_found": NotFound, "state": StateError, "resources": ResourceError,
            "busy": Busy}[code](message)


class NodeNotUp(ClusterError):
    code = "not_up"


def submit(conn: Conn, fields: dict[str, Any],
           expand: Callable[[int, int | None, int | None], tuple[str, str]]) -> dict[str, Any]:
    """Queue a job (an array: one row per index) for the user this node authenticated:
    ``fields`` are its columns, with ``array`` {indices, max} and ``dependency`` as
    tether_submit takes them. ``expand(id, index, array id)`` gives each row's output and
    error names, written in the same transaction (no node ever claims a row without them).
    Returns the first row's job object."""
    indices = (fields.get("array") or {}).get("indices") or [None]
    with conn.transaction():
        ids = [int(i) for i in call(conn, "SELECT tether_submit(%s)", (Jsonb(fields),))]
        first = ids[0] if fields.get("array") else None
        names = [[job, *expand(job, index, first)] for job, index in zip(ids, indices,
                                                                          strict=True)]
        call(conn, "SELECT tether_set_outputs(%s)", (Jsonb(names),))
    return get_job(conn, ids[0])


def cancel(conn: Conn, job_id: int, uid: int) -> dict[str, Any]:
    """A queued job ends here; a running one is asked of its node (which reports the end)."""
    call(conn, "SELECT tether_cancel(%s, %s)", (job_id, uid))
    return get_job(conn, job_id)


def hold(conn: Conn, job_id: int, uid: int, held: bool) -> None:
    call(conn, "SELECT tether_hold(%s, %s, %s)", (job_id, uid, held))


#: a pending job's fair-share factor beside its columns (``public_job`` shows its priority):
#: every user's, computed once per statement, read only for pending rows
_WITH_FACTORS = "WITH f AS MATERIALIZED (SELECT * FROM tether_factors()) "
_FACTOR = (", CASE WHEN state = 'pending' THEN (SELECT f_factor FROM f WHERE f_uid = "
           "tether_jobs.uid) END AS factor")


def get_row(conn: Conn, job_id: int) -> dict[str, Any]:
    row = conn.execute(f"{_WITH_FACTORS}SELECT {JOB_COLUMNS}{_FACTOR} FROM tether_jobs "
                       "WHERE id = %s", (job_id,)).fetchone()
    if row is None:
        raise NotFound(f"no job {job_id}")
    return row


def get_job(conn: Conn, job_id: int) -> dict[str, Any]:
    return public_job(get_row(conn, job_id))


def list_jobs(conn: Conn, after: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
    rows = conn.execute(f"{_WITH_FACTORS}SELECT {JOB_COLUMNS}{_FACTOR} FROM tether_jobs "
                        "WHERE id > %s ORDER BY id "
                        "LIMIT %s", (after, limit)).fetchall()
    return [public_job(r) for r in rows]


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
        "reason": r["reason"], "state_dir": r["state_dir"], "login": r["login"],
    } for r in rows]


def set_drain(conn: Conn, node: str, drain: bool, uid: int) -> None:
    call(conn, "SELECT tether_set_drain(%s, %s, %s)", (node, drain, uid))


def where(conn: Conn, job_id: int) -> dict[str, Any]:
    """Where a job's current attempt runs: node, host, state dir and the node's local job id."""
    row = conn.execute(
        "SELECT j.id, j.state, j.node, j.local_job, j.attempt, j.uid, j.username, n.host, "
        "n.state_dir FROM tether_jobs j "
        "LEFT JOIN tether_nodes n ON n.name = j.node WHERE j.id = %s", (job_id,)).fetchone()
    if row is None:
        raise NotFound(f"no job {job_id}")
    return row


def listen(conn: Conn, *channels: str) -> None:
    for channel in channels:
        conn.execute(f"LISTEN {channel}")  # channel names are our constants, never input


# ---- accounting -----------------------------------------------------------------------------


def acct(conn: Conn, *, after: int = 0, limit: int = 500,
         refs: list[tuple[int, int | None]] | None = None, users: list[str] | None = None,
         states: list[str] | None = None, names: list[str] | None = None,
         since: float | None = None, until: float | None = None,
         uid: int | None = None) -> list[dict[str, Any]]:
    """The cluster's ended jobs as ``tether acct`` shows them (agent/acct.py's records, the
    cluster's ids and each job's node), filtered as a node's history is (agent/acct.py
    ``query``); what the step used is what its node reported with the result (``usage``)."""
    where = ["state = ANY(%s)", "id > %s"]
    params: list[Any] = [list(FINAL), after]
    if refs is not None:
        parts = []
        for job, index in refs:
            if index is None:
                parts.append("(id = %s OR array_id = %s)")
                params += [job, job]
            else:
                parts.append("(array_id = %s AND array_index = %s)")
                params += [job, index]
        where.append("(" + (" OR ".join(parts) or "false") + ")")
    for column, values in (("username", users), ("state", states), ("name", names)):
        if values is not None:
            where.append(f"{column} = ANY(%s)")
            params.append(list(values))
    if uid is not None:
        where.append("uid = %s")
        params.append(uid)
    # the stamps are RFC 3339 in UTC of one form: as text they sort as the times they name
    if since is not None:
        where.append("ended_at >= %s")
        params.append(stamps.stamp(since))
    if until is not None:
        where.append("coalesce(started_at, ended_at) <= %s")
        params.append(stamps.stamp(until))
    rows = conn.execute(f"SELECT {JOB_COLUMNS} FROM tether_jobs WHERE {' AND '.join(where)} "
                        "ORDER BY id LIMIT %s", (*params, limit)).fetchall()
    return [acct_record(r) for r in rows]


def acct_record(r: dict[str, Any]) -> dict[str, Any]:
    u = r["usage"] if isinstance(r["usage"], dict) else {}
    started, ended = stamps.epoch(r["started_at"]), stamps.epoch(r["ended_at"])
    suspended = float(u.get("suspended") or 0.0)
    elapsed = None if started is None or ended is None else round(
        max(0.0, ended - started - suspended), 3)
    cpu_user, cpu_system = u.get("cpu_user"), u.get("cpu_system")
    cpu = None if cpu_user is None and cpu_system is None else round(
        (cpu_user or 0.0) + (cpu_system or 0.0), 3)
    return {
        "id": r["id"], "array_id": r["array_id"], "array_index": r["array_index"],
        "name": r["name"], "user": r["username"], "uid": r["uid"], "node": r["node"],
        "state": r["state"], "exit_code": r["exit_code"], "signal": r["signal"],
        "oom": bool(u.get("oom")), "submitted_at": r["submitted_at"],
        "started_at": r["started_at"], "ended_at": r["ended_at"], "elapsed": elapsed,
        "suspended_seconds": suspended, "attempts": r["attempt"], "ntasks": r["ntasks"],
        "cpus": r["cpus_per_task"] * r["ntasks"], "gpus": r["gpus_req"],
        "memory_mb": r["memory_mb"], "time_limit": r["time_limit"], "cpu_user": cpu_user,
        "cpu_system": cpu_system, "cpu_total": cpu, "maxrss_kb": u.get("maxrss_kb"),
        "task_maxrss_kb": u.get("task_maxrss_kb"), "usage_from": u.get("usage_from"),
    }
