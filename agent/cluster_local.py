"""What this node ran for the cluster, in the agent's own SQLite (I/O): the link between a
local job and the cluster's (job, attempt), and the durable outbox of results.

One row per cluster attempt taken here, written in the same local transaction as the local job
(so a local job run for the cluster always knows which attempt it is). ``status``:

- ``open``: the attempt is this node's; once the local job is final its result is owed to the
  cluster (the outbox is: open rows whose local job is final);
- ``reported``: the cluster recorded the result;
- ``refused``: the cluster refused it (the attempt was no longer current): dropped;
- ``discarded``: the attempt stopped being current while it ran or waited here; it was killed
  and whatever it ends with is never reported.

The table lives beside ``jobs`` in the same file so both are written in one transaction; the
standalone agent never creates or reads it.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from tether.shared import outpattern
from tether.shared.timers import rfc3339_now

_TABLE = """
CREATE TABLE IF NOT EXISTS cluster_runs (
    local_job INTEGER PRIMARY KEY,
    cluster_job INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    status TEXT NOT NULL DEFAULT 'open',
    UNIQUE (cluster_job, attempt)
)
"""


@dataclass(frozen=True, slots=True)
class Run:
    local_job: int
    cluster_job: int
    attempt: int
    status: str


def ensure(conn: sqlite3.Connection) -> None:
    conn.execute(_TABLE)


def _run(row: Any) -> Run:
    return Run(int(row[0]), int(row[1]), int(row[2]), str(row[3]))


def record(conn: sqlite3.Connection, row: dict[str, Any], attempt: int, node_name: str) -> int:
    """Insert the local job for a claimed cluster row and link it; the caller's transaction.

    The tasks' own TETHER_JOB_ID and TETHER_ATTEMPT are this node's; the cluster's are added."""
    env = dict(row["env"], TETHER_CLUSTER_JOB_ID=str(row["id"]),
               TETHER_CLUSTER_ATTEMPT=str(attempt))
    if row.get("array_id") is not None:  # the array's cluster id, as a node's own arrays say it
        env.update(TETHER_ARRAY_JOB_ID=str(row["array_id"]),
                   TETHER_ARRAY_TASK_ID=str(row["array_index"]))
    node = {"N": node_name}  # the one token only the claiming node knows
    output, error = outpattern.for_job(row["output"], node), outpattern.for_job(row["error"], node)
    cur = conn.execute(
        "INSERT INTO jobs (name, command, state, cpus_per_task, ntasks, gpus_req, memory_mb, "
        "output, error, workdir, env, submitted_at, pmi, user, uid, gid) VALUES "
        "(?, ?, 'pending', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (row["name"], json.dumps(row["command"]), row["cpus_per_task"], row["ntasks"],
         row["gpus_req"], row["memory_mb"], output, error, row["workdir"],
         json.dumps(env), row["submitted_at"] or rfc3339_now(), row["pmi"],
         row["username"], row["uid"], row["gid"]))
    local = cur.lastrowid
    assert local is not None
    # the submitter's umask: its output files' and its tasks' (as on one node)
    conn.execute("INSERT OR REPLACE INTO job_umask (id, umask) VALUES (?, ?)",
                 (local, int(row.get("umask", 0o022))))
    if row.get("time_limit") is not None:  # enforced by its supervisor, as on one node
        conn.execute("INSERT INTO job_sched (id, time_limit) VALUES (?, ?)",
                     (local, float(row["time_limit"])))
    conn.execute("INSERT INTO cluster_runs (local_job, cluster_job, attempt) VALUES (?, ?, ?)",
                 (local, row["id"], attempt))
    return int(local)


def invalid(row: dict[str, Any]) -> str | None:
    """Why a claimed row cannot become a local job, or None. The database checks rows already
    (``tether_invalid``); this is the node's own check of what it is about to run as root's
    agent, so a row that slipped through fails with a reason instead of breaking the claim."""
    command, env = row.get("command"), row.get("env")
    if not isinstance(command, list) or not command or not all(
            isinstance(a, str) for a in command) or not command[0]:
        return "command must be a non-empty array of strings"
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
            for k, v in env.items()):
        return "env must map variable names to string values"
    for key in ("cpus_per_task", "ntasks", "gpus_req", "memory_mb", "uid", "gid", "umask"):
        if not isinstance(row.get(key), int) or isinstance(row.get(key), bool) or row[key] < 0:
            return f"{key} must be a whole number"
    for key in ("name", "output", "error", "workdir", "username", "pmi"):
        if not isinstance(row.get(key), str):
            return f"{key} must be text"
    return None


def script_of(row: dict[str, Any]) -> bytes | None:
    """A claimed row's batch script: PostgreSQL's bytea as JSON gives it (``\\x`` and hex)."""
    text = row.get("script")
    if not isinstance(text, str) or not text.startswith("\\x"):
        return None
    try:
        return bytes.fromhex(text[2:]) or None
    except ValueError:
        return None


def current_run(conn: sqlite3.Connection, cluster_job: int) -> Run | None:
    """The open run of ``cluster_job`` on this node (its latest attempt), if any."""
    row = conn.execute("SELECT local_job, cluster_job, attempt, status FROM cluster_runs WHERE "
                       "cluster_job = ? AND status = 'open' ORDER BY attempt DESC LIMIT 1",
                       (cluster_job,)).fetchone()
    return None if row is None else _run(row)


def get(conn: sqlite3.Connection, local_job: int) -> Run | None:
    row = conn.execute("SELECT local_job, cluster_job, attempt, status FROM cluster_runs WHERE "
                       "local_job = ?", (local_job,)).fetchone()
    return None if row is None else _run(row)


def find(conn: sqlite3.Connection, cluster_job: int, attempt: int) -> Run | None:
    row = conn.execute("SELECT local_job, cluster_job, attempt, status FROM cluster_runs WHERE "
                       "cluster_job = ? AND attempt = ?", (cluster_job, attempt)).fetchone()
    return None if row is None else _run(row)


def open_runs(conn: sqlite3.Connection) -> list[tuple[Run, str]]:
    """Every open attempt with its local job's state (oldest first)."""
    rows = conn.execute(
        "SELECT r.local_job, r.cluster_job, r.attempt, r.status, j.state FROM cluster_runs r "
        "JOIN jobs j ON j.id = r.local_job WHERE r.status = 'open' ORDER BY r.local_job")
    return [(_run(r), str(r[4])) for r in rows]


def set_status(conn: sqlite3.Connection, local_job: int, status: str) -> None:
    conn.execute("UPDATE cluster_runs SET status = ? WHERE local_job = ?", (status, local_job))
