"""The cluster's PostgreSQL schema and the pure parts of reading it (no I/O, no psycopg).

The database holds the cluster's jobs, nodes and attempts; each node's SQLite stays the record of
what runs on that node. Tables carry a ``tether_`` prefix so they can share a database.

Versioning: ``tether_meta.schema_version`` names the last migration applied. ``MIGRATIONS[n]``
takes a database from version n-1 to n; ``tether cluster init`` applies the missing ones under
an advisory lock (idempotent), and every client refuses a database newer than it knows.

Job states are those of a standalone node: ``pending`` (queued cluster-wide, ``node`` null),
``starting`` and ``running`` (claimed by ``node`` for ``attempt``), then one final state.
``attempt`` counts claims: a claim sets ``attempt + 1``, so a result names the attempt it
belongs to and one for any other attempt is refused.
"""

from __future__ import annotations

import time
from typing import Any

from tether.shared import jobstates

SCHEMA_VERSION = 3

#: Key of ``pg_advisory_xact_lock`` taken by ``cluster init`` (so two inits do not race).
INIT_LOCK = 0x7465746865720001

#: Default of ``heartbeat_timeout`` (seconds) when ``cluster init`` is not given one.
DEFAULT_HEARTBEAT_TIMEOUT = 30.0
#: Default of ``fence_margin`` (seconds): a lost node's jobs run elsewhere only this long after
#: its steps fenced themselves (shared/lease.py): their check every second, the kill, clocks.
DEFAULT_FENCE_MARGIN = 5.0

#: NOTIFY channels. ``queue``: work may be claimable (a submit, freed resources, a resume).
#: ``job``: payload a job id; its state changed or a cancel was asked for.
CHANNEL_QUEUE = "tether_queue"
CHANNEL_JOB = "tether_job"
#: payload a node's name: another node asked something of one of its steps (cluster_relay.py)
CHANNEL_ASK = "tether_ask"
#: payload an ask's id: it was answered
CHANNEL_ANSWER = "tether_answer"

#: the states and their moves are shared/jobstates.py's (one table for a node and the cluster)
ACTIVE, FINAL = jobstates.ACTIVE, jobstates.FINAL

MIGRATIONS: dict[int, str] = {
    1: """
CREATE TABLE tether_nodes (
    name text PRIMARY KEY,
    host text NOT NULL,
    state_dir text NOT NULL,
    state text NOT NULL CHECK (state IN ('up', 'down')),
    drain boolean NOT NULL DEFAULT false,
    cpus integer NOT NULL,
    gpus integer NOT NULL,
    memory_mb bigint NOT NULL,
    version text NOT NULL,
    session text NOT NULL,
    heartbeat timestamptz NOT NULL,
    registered_at timestamptz NOT NULL,
    reason text
);
CREATE TABLE tether_jobs (
    id bigserial PRIMARY KEY,
    name text NOT NULL,
    command jsonb NOT NULL,
    state text NOT NULL,
    attempt integer NOT NULL DEFAULT 0,
    node text,
    local_job bigint,
    exit_code integer,
    signal integer,
    reason text,
    cpus_per_task integer NOT NULL,
    ntasks integer NOT NULL,
    gpus_req integer NOT NULL,
    memory_mb bigint NOT NULL,
    cpus jsonb NOT NULL DEFAULT '[]',
    gpus jsonb NOT NULL DEFAULT '[]',
    supervisor_pid integer,
    pids jsonb NOT NULL DEFAULT '[]',
    output text NOT NULL,
    error text NOT NULL,
    workdir text NOT NULL,
    env jsonb NOT NULL,
    submitted_at text NOT NULL,
    started_at text,
    ended_at text,
    cancel_requested boolean NOT NULL DEFAULT false,
    requeue boolean NOT NULL DEFAULT true,
    pmi text NOT NULL DEFAULT 'none',
    username text,
    uid integer,
    gid integer
);
CREATE INDEX tether_jobs_queue ON tether_jobs (id) WHERE state = 'pending';
CREATE INDEX tether_jobs_node ON tether_jobs (node) WHERE node IS NOT NULL;
CREATE TABLE tether_attempts (
    job bigint NOT NULL REFERENCES tether_jobs (id),
    attempt integer NOT NULL,
    node text NOT NULL,
    state text NOT NULL,
    reason text,
    claimed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at timestamptz,
    PRIMARY KEY (job, attempt)
);
""",
    # Nodes become principals: each node logs in as its own role (``role``), and every change
    # goes through the functions of cluster_funcs.py, which know the node from ``session_user``.
    2: """
ALTER TABLE tether_nodes ADD COLUMN role text UNIQUE;
ALTER TABLE tether_nodes ADD COLUMN login boolean NOT NULL DEFAULT false;
ALTER TABLE tether_jobs ADD COLUMN submit_node text;
ALTER TABLE tether_jobs ADD COLUMN groups jsonb NOT NULL DEFAULT '[]';
ALTER TABLE tether_jobs ADD COLUMN held boolean NOT NULL DEFAULT false;
ALTER TABLE tether_jobs ADD COLUMN cancelled_by text;
ALTER TABLE tether_jobs ADD COLUMN umask integer NOT NULL DEFAULT 18;
ALTER TABLE tether_jobs ADD COLUMN time_limit float8;
ALTER TABLE tether_jobs ADD COLUMN begin_at float8;
ALTER TABLE tether_jobs ADD COLUMN dependency jsonb NOT NULL DEFAULT '[]';
ALTER TABLE tether_jobs ADD COLUMN array_id bigint;
ALTER TABLE tether_jobs ADD COLUMN array_index integer;
ALTER TABLE tether_jobs ADD COLUMN array_max integer;
CREATE INDEX tether_jobs_array ON tether_jobs (array_id) WHERE array_id IS NOT NULL;
ALTER TABLE tether_jobs ADD COLUMN usage jsonb;
ALTER TABLE tether_jobs ADD COLUMN script bytea;
ALTER TABLE tether_jobs ADD COLUMN slurm_env boolean NOT NULL DEFAULT false;
CREATE INDEX tether_jobs_ended ON tether_jobs (ended_at) WHERE ended_at IS NOT NULL;
CREATE TABLE tether_asks (
    id bigserial PRIMARY KEY,
    from_node text NOT NULL,
    to_node text NOT NULL,
    job bigint NOT NULL,
    local_job bigint NOT NULL,
    uid integer NOT NULL,
    kind text NOT NULL,
    args jsonb NOT NULL,
    answer jsonb,
    taken boolean NOT NULL DEFAULT false,
    asked_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX tether_asks_to ON tether_asks (to_node) WHERE NOT taken;
""",
    # The cluster schedules as one node does (shared/cluster_sched.py): each user's usage for
    # fair share (allocated CPU-seconds, decayed: as of ``as_of``, epoch seconds), each pending
    # job's reason as the last plan saw it, and an index for ``singleton``. Usage of the jobs
    # that ended before the upgrade is not counted: fair share starts from the upgrade.
    3: """
CREATE TABLE tether_usage (
    uid integer PRIMARY KEY,
    cpu_seconds float8 NOT NULL,
    as_of float8 NOT NULL
);
ALTER TABLE tether_jobs ADD COLUMN pending_reason text;
CREATE INDEX tether_jobs_user_name ON tether_jobs (uid, name)
    WHERE state IN ('pending', 'starting', 'running');
""",
}

META = """
CREATE TABLE IF NOT EXISTS tether_meta (key text PRIMARY KEY, value text NOT NULL)
"""

#: Columns of ``tether_jobs`` read into a job object (``username`` is the wire's ``user``).
#: Not ``env``: nodes may read every column but that one (a job's environment holds its
#: owner's secrets; a node sees it only for the jobs it claims, from ``tether_claim``).
JOB_COLUMNS = (
    "id, name, command, state, attempt, node, local_job, exit_code, signal, reason, "
    "cpus_per_task, ntasks, gpus_req, memory_mb, cpus, gpus, supervisor_pid, pids, output, "
    "error, workdir, submitted_at, started_at, ended_at, cancel_requested, requeue, pmi, "
    "username, uid, gid, submit_node, groups, held, cancelled_by, umask, time_limit, begin_at, "
    "dependency, array_id, array_index, array_max, usage, slurm_env, pending_reason"
)


class SchemaError(Exception):
    """The database holds no tether schema, or one this build does not know."""


def check_version(found: int | None) -> None:
    if found is None:
        raise SchemaError("the database holds no tether schema: run `tether cluster init`")
    if found > SCHEMA_VERSION:
        raise SchemaError(f"the database's tether schema is version {found}, newer than this "
                          f"tether's {SCHEMA_VERSION}: upgrade tether")
    if found < SCHEMA_VERSION:
        raise SchemaError(f"the database's tether schema is version {found}, older than this "
                          f"tether's {SCHEMA_VERSION}: run `tether cluster init`")


def public_job(row: dict[str, Any]) -> dict[str, Any]:
    """The job object of the CLI contract (as a standalone agent's), plus ``node``."""
    return {
        "id": row["id"], "name": row["name"], "command": row["command"],
        "state": row["state"], "attempt": row["attempt"], "exit_code": row["exit_code"],
        "signal": row["signal"], "reason": row["reason"], "cpus": row["cpus"],
        "gpus": row["gpus"], "memory_mb": row["memory_mb"], "ntasks": row["ntasks"],
        "cpus_per_task": row["cpus_per_task"], "supervisor_pid": row["supervisor_pid"],
        "pids": row["pids"], "output": row["output"], "error": row["error"],
        "workdir": row["workdir"], "submitted_at": row["submitted_at"],
        "started_at": row["started_at"], "ended_at": row["ended_at"], "pmi": row["pmi"],
        "user": row["username"], "uid": row["uid"], "node": row["node"],
        "requeue": row["requeue"], "held": row["held"], "submit_node": row["submit_node"],
        "time_limit": row["time_limit"], "begin_at": row["begin_at"],
        "dependency": [dependency_text(d) for d in row["dependency"] or []],
        "array_id": row["array_id"], "array_index": row["array_index"],
        "priority": priority(row),
    } | ({"reason": pending_reason(row)} if row["state"] == "pending" and not row["reason"]
         else {})


def dependency_text(dep: list[Any]) -> str:
    """A dependency as a node shows it (agent/job.py): ``KIND:ID``, ``KIND:ID_*`` for a whole
    array (stored as ``[kind, -id]``), ``singleton`` alone."""
    kind, ref = str(dep[0]), int(dep[1])
    if kind == "singleton":
        return kind
    return f"{kind}:{-ref}_*" if ref < 0 else f"{kind}:{ref}"


def priority(row: dict[str, Any]) -> int | None:
    """A pending job's fair-share priority (its user's factor, ``tether_factors``, times a
    node's scale: agent/fairshare.py), None for any other or when the query did not ask."""
    factor = row.get("factor")
    if row["state"] != "pending" or factor is None:
        return None
    return round(float(factor) * 1_000_000)


def pending_reason(row: dict[str, Any]) -> str:
    """Why a queued cluster job waits, in Slurm's words (as a node's ``list`` says them): the
    last plan's word (``tether_claim``), or what the row says before any plan saw it."""
    if row["held"]:
        return "JobHeldUser"
    if row["begin_at"] is not None and row["begin_at"] > time.time():
        return "BeginTime"
    if row.get("pending_reason"):
        return str(row["pending_reason"])
    if row["dependency"]:
        return "Dependency"
    return "Resources"


def node_state(state: str, drain: bool) -> str:
    """``up``, ``down`` or ``draining`` (an up node that takes no new work)."""
    if state == "down":
        return "down"
    return "draining" if drain else "up"


def demand(row: dict[str, Any]) -> tuple[int, int, int]:
    """What a job holds while it runs: (CPUs, GPUs, MB)."""
    return (int(row["cpus_per_task"]) * int(row["ntasks"]), int(row["gpus_req"]),
            int(row["memory_mb"]))


def never_fits(need: tuple[int, int, int], size: tuple[int, int, int]) -> str | None:
    """Why a job needing ``need`` could not run even on an empty node of ``size``, or None."""
    for label, want, have in zip(("CPUs", "GPUs", "MB of memory"), need, size, strict=True):
        if want > have:
            return f"needs {want} {label} but has {have}"
    return None
