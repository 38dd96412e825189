"""The accounting history (``tether acct``, Slurm's ``sacct``): one compact row per ended job
(I/O).

A table of its own (``job_acct``, schema 9), written in the same transaction as a job's final
state (``effects.finalize``) and never read by anything that runs jobs: purging ended jobs from
the jobs table (``list``) leaves it whole, and nothing else deletes from it. A row holds what
``sacct`` shows of a job (no environment, no command line, no paths: ~200 bytes): who, what it
asked for, how and when it ended, and what its step used, as the step's supervisor measured it
at the end (its cgroup's counters, else the tasks' rusage; ``lifecycle_events.Usage``).

Times are epoch seconds (so that ``--since``/``--until`` are index ranges); the job object's
RFC 3339 form is made on the way out (``public``).
"""

from __future__ import annotations

import sqlite3
import time
from typing import TYPE_CHECKING, Any

from tether.agent.job import FINAL, Job
from tether.agent.lifecycle_events import Usage
from tether.shared import stamps

if TYPE_CHECKING:
    from tether.agent.store_api import StoreApi as Store

#: the columns, in the order ``public`` reads them
COLUMNS = ("job", "array_id", "array_index", "name", "user", "uid", "state", "exit_code",
           "signal", "oom", "submitted", "started", "ended", "suspended", "attempts", "ntasks",
           "cpus", "gpus", "memory_mb", "time_limit", "cpu_user", "cpu_system", "maxrss_kb",
           "task_maxrss_kb", "usage_from")

_TABLE = """
CREATE TABLE IF NOT EXISTS job_acct (
    job INTEGER PRIMARY KEY,
    array_id INTEGER,
    array_index INTEGER,
    name TEXT NOT NULL,
    user TEXT,
    uid INTEGER,
    state TEXT NOT NULL,
    exit_code INTEGER,
    signal INTEGER,
    oom INTEGER NOT NULL DEFAULT 0,
    submitted REAL,
    started REAL,
    ended REAL NOT NULL,
    suspended REAL NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    ntasks INTEGER NOT NULL,
    cpus INTEGER NOT NULL,
    gpus INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    time_limit REAL,
    cpu_user REAL,
    cpu_system REAL,
    maxrss_kb INTEGER,
    task_maxrss_kb INTEGER,
    usage_from TEXT
)"""
_INDEXES = ("CREATE INDEX IF NOT EXISTS job_acct_ended ON job_acct(ended)",
            "CREATE INDEX IF NOT EXISTS job_acct_user ON job_acct(user, ended)",
            "CREATE INDEX IF NOT EXISTS job_acct_uid ON job_acct(uid, ended)",
            "CREATE INDEX IF NOT EXISTS job_acct_array ON job_acct(array_id)")
_INSERT = (f"INSERT OR REPLACE INTO job_acct ({', '.join(COLUMNS)}) "
           f"VALUES ({', '.join('?' for _ in COLUMNS)})")


def create(conn: sqlite3.Connection) -> None:
    """The table (schema 9), and a row for every job that had already ended (no usage)."""
    conn.execute(_TABLE)
    for stmt in _INDEXES:
        conn.execute(stmt)
    marks = ", ".join("?" for _ in FINAL)
    rows = conn.execute(
        "SELECT jobs.id, s.array_id, s.array_index, jobs.name, jobs.user, jobs.uid, jobs.state, "
        "jobs.exit_code, jobs.signal, COALESCE(cg.oom, 0), jobs.submitted_at, jobs.started_at, "
        "jobs.ended_at, COALESCE(cg.suspended_seconds, 0), jobs.attempt, jobs.ntasks, "
        "jobs.cpus_per_task * jobs.ntasks, jobs.gpus_req, jobs.memory_mb, s.time_limit "
        "FROM jobs LEFT JOIN job_sched s ON s.id = jobs.id "
        f"LEFT JOIN job_cgroup cg ON cg.job = jobs.id WHERE jobs.state IN ({marks})",
        FINAL).fetchall()
    for r in rows:
        submitted, started, ended = (stamps.epoch(t) for t in (r[10], r[11], r[12]))
        conn.execute(_INSERT, (*r[:10], submitted, started,
                               ended if ended is not None else submitted or 0.0,
                               *r[13:], None, None, None, None, None))


def row_of(job: Job, usage: Usage | None) -> tuple[Any, ...]:
    """A final job's row (``job`` as recorded by ``finalize``)."""
    ended = stamps.epoch(job.ended_at)
    u = usage or Usage()
    return (job.id, job.array_id, job.array_index, job.name, job.user, job.uid, job.state,
            job.exit_code, job.signal, int(job.oom), stamps.epoch(job.submitted_at),
            stamps.epoch(job.started_at), time.time() if ended is None else ended,
            float(job.suspended_seconds), job.attempt, job.ntasks,
            job.cpus_per_task * job.ntasks, job.gpus_req, job.memory_mb, job.time_limit,
            u.cpu_user, u.cpu_system, u.maxrss_kb, u.task_maxrss_kb, u.source)


def record(db: Store, job: Job, usage: Usage | None) -> None:
    """Write ``job``'s row (in the caller's transaction: with its final state, or neither)."""
    db._exec(_INSERT, row_of(job, usage))


def usage_of(db: Store, job: int) -> dict[str, Any] | None:
    """What an ended job's step used, as its row holds it (for the cluster's record of it)."""
    row = db.conn.execute("SELECT cpu_user, cpu_system, maxrss_kb, task_maxrss_kb, usage_from, "
                          "oom, suspended FROM job_acct WHERE job = ?", (job,)).fetchone()
    if row is None:
        return None
    return dict(zip(("cpu_user", "cpu_system", "maxrss_kb", "task_maxrss_kb", "usage_from",
                     "oom", "suspended"), row, strict=True))


def states_of(db: Store, ids: set[int]) -> dict[int, str]:
    """How these jobs ended, for those the history holds."""
    return db.states_of(ids, table="job_acct", key="job")


def array_states(db: Store, array_id: int) -> dict[int, str]:
    """How the elements of an array that the history holds ended, by index."""
    rows = db.conn.execute("SELECT array_index, state FROM job_acct WHERE array_id = ?",
                           (array_id,))
    return {int(index): str(state) for index, state in rows if index is not None}


def query(db: Store, *, after: int = 0, limit: int = 500,
          refs: list[tuple[int, int | None]] | None = None, users: list[str] | None = None,
          states: list[str] | None = None, names: list[str] | None = None,
          since: float | None = None, until: float | None = None,
          uid: int | None = None) -> list[tuple[Any, ...]]:
    """Rows in id order after ``after``: those of the jobs ``refs`` name (``(ID, None)``: the
    job, or every element of the array ID; ``(ID, INDEX)``: one element), run by ``users``,
    in ``states``, named ``names``, that ran within [``since``, ``until``] (ended at or after
    ``since``, started, or ended unstarted, at or before ``until``), run as ``uid``; None:
    any."""
    where = ["job > ?"]
    params: list[Any] = [after]
    if refs is not None:
        parts = []
        for job, index in refs:
            if index is None:
                parts.append("(job = ? OR array_id = ?)")
                params += [job, job]
            else:
                parts.append("(array_id = ? AND array_index = ?)")
                params += [job, index]
        where.append("(" + (" OR ".join(parts) or "0") + ")")
    for column, values in (("user", users), ("state", states), ("name", names)):
        if values is not None:
            where.append(f"{column} IN ({', '.join('?' for _ in values)})" if values else "0")
            params += list(values)
    if uid is not None:
        where.append("uid = ?")
        params.append(uid)
    if since is not None:
        where.append("ended >= ?")
        params.append(since)
    if until is not None:
        where.append("COALESCE(started, ended) <= ?")
        params.append(until)
    return db.conn.execute(f"SELECT {', '.join(COLUMNS)} FROM job_acct WHERE "
                           f"{' AND '.join(where)} ORDER BY job LIMIT ?",
                           (*params, limit)).fetchall()


def public(row: tuple[Any, ...], node: str) -> dict[str, Any]:
    """An accounting record as ``tether acct --json`` prints it."""
    r = dict(zip(COLUMNS, row, strict=True))
    started, ended = r["started"], r["ended"]
    elapsed = None if started is None else round(max(0.0, ended - started - r["suspended"]), 3)
    cpu = None if r["cpu_user"] is None and r["cpu_system"] is None else round(
        (r["cpu_user"] or 0.0) + (r["cpu_system"] or 0.0), 3)
    return {
        "id": r["job"], "array_id": r["array_id"], "array_index": r["array_index"],
        "name": r["name"], "user": r["user"], "uid": r["uid"], "node": node,
        "state": r["state"], "exit_code": r["exit_code"], "signal": r["signal"],
        "oom": bool(r["oom"]),
        "submitted_at": None if r["submitted"] is None else stamps.stamp(r["submitted"]),
        "started_at": None if started is None else stamps.stamp(started),
        "ended_at": stamps.stamp(ended), "elapsed": elapsed,
        "suspended_seconds": r["suspended"], "attempts": r["attempts"], "ntasks": r["ntasks"],
        "cpus": r["cpus"], "gpus": r["gpus"], "memory_mb": r["memory_mb"],
        "time_limit": r["time_limit"], "cpu_user": r["cpu_user"],
        "cpu_system": r["cpu_system"], "cpu_total": cpu, "maxrss_kb": r["maxrss_kb"],
        "task_maxrss_kb": r["task_maxrss_kb"], "usage_from": r["usage_from"],
    }
