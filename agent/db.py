"""The agent's durable state: SQLite in WAL mode with synchronous=FULL (I/O).

It holds intent (what the agent asked for: the job, its attempt, its allocation) and history
(what supervisors told it: pids, results). It never holds a guess about a running step. Every
write commits before the caller replies to anyone or spawns anything.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from typing import Any

from tether.agent.ledger import Allocation

ACTIVE = ("starting", "running")
FINAL = ("completed", "failed", "cancelled", "lost")
STATES = ("pending", *ACTIVE, *FINAL)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    command TEXT NOT NULL,
    state TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,
    exit_code INTEGER,
    signal INTEGER,
    reason TEXT,
    cpus_per_task INTEGER NOT NULL,
    ntasks INTEGER NOT NULL,
    gpus_req INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    cpus TEXT NOT NULL DEFAULT '[]',
    gpus TEXT NOT NULL DEFAULT '[]',
    supervisor_pid INTEGER,
    supervisor_ticks INTEGER,
    pids TEXT NOT NULL DEFAULT '[]',
    output TEXT NOT NULL,
    error TEXT NOT NULL,
    workdir TEXT NOT NULL,
    env TEXT NOT NULL,
    submitted_at TEXT NOT NULL,
    started_at TEXT,
    ended_at TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    pmi TEXT NOT NULL DEFAULT 'none',
    user TEXT,
    uid INTEGER,
    gid INTEGER,
    umask INTEGER
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, id);
"""


_ADDED_COLUMNS = {"pmi": "TEXT NOT NULL DEFAULT 'none'", "user": "TEXT", "uid": "INTEGER",
                  "gid": "INTEGER", "umask": "INTEGER"}


@dataclass
class Job:
    id: int
    name: str
    command: list[str]
    state: str
    attempt: int
    exit_code: int | None
    signal: int | None
    reason: str | None
    cpus_per_task: int
    ntasks: int
    gpus_req: int
    memory_mb: int
    cpus: list[int]
    gpus: list[int]
    supervisor_pid: int | None
    supervisor_ticks: int | None
    pids: list[int]
    output: str
    error: str
    workdir: str
    env: dict[str, str] = field(repr=False)
    submitted_at: str
    started_at: str | None
    ended_at: str | None
    cancel_requested: bool
    pmi: str = "none"
    user: str | None = None
    uid: int | None = None
    gid: int | None = None
    #: the submitter's umask, applied to the output files and the tasks (null: 022)
    umask: int | None = None

    @property
    def allocation(self) -> Allocation:
        return Allocation(tuple(self.cpus), tuple(self.gpus), self.memory_mb)

    @property
    def final(self) -> bool:
        return self.state in FINAL

    def public(self) -> dict[str, Any]:
        """The job object of the CLI contract."""
        return {
            "id": self.id, "name": self.name, "command": self.command, "state": self.state,
            "attempt": self.attempt, "exit_code": self.exit_code, "signal": self.signal,
            "reason": self.reason, "cpus": self.cpus, "gpus": self.gpus,
            "memory_mb": self.memory_mb, "ntasks": self.ntasks,
            "cpus_per_task": self.cpus_per_task, "supervisor_pid": self.supervisor_pid,
            "pids": self.pids, "output": self.output, "error": self.error,
            "workdir": self.workdir, "submitted_at": self.submitted_at,
            "started_at": self.started_at, "ended_at": self.ended_at, "pmi": self.pmi,
            "user": self.user, "uid": self.uid,
        }


_JSON_COLS = ("command", "cpus", "gpus", "pids", "env")


def _row(row: sqlite3.Row) -> Job:
    d = dict(row)
    for col in _JSON_COLS:
        d[col] = json.loads(d[col])
    d["cancel_requested"] = bool(d["cancel_requested"])
    return Job(**d)


class Store:
    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.executescript(_SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Columns added after the first release: an older database gains them in place."""
        have = {row[1] for row in self.conn.execute("PRAGMA table_info(jobs)")}
        for column, ddl in _ADDED_COLUMNS.items():
            if column not in have:
                self.conn.execute(f"ALTER TABLE jobs ADD COLUMN {column} {ddl}")

    def close(self) -> None:
        self.conn.close()

    def begin(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self.conn.execute("COMMIT")

    def rollback(self) -> None:
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")

    def insert(self, **fields: Any) -> Job:
        for col in _JSON_COLS:
            if col in fields:
                fields[col] = json.dumps(fields[col])
        cols = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        cur = self.conn.execute(f"INSERT INTO jobs ({cols}) VALUES ({marks})",
                                tuple(fields.values()))
        job_id = cur.lastrowid
        assert job_id is not None
        return self.get_required(job_id)

    def last_id(self) -> int:
        """The highest id ever given (AUTOINCREMENT never reuses one)."""
        row = self.conn.execute(
            "SELECT COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'jobs'), 0)"
        ).fetchone()
        return int(row[0])

    def update(self, job_id: int, **fields: Any) -> Job:
        for col in _JSON_COLS:
            if col in fields:
                fields[col] = json.dumps(fields[col])
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.conn.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*fields.values(), job_id))
        return self.get_required(job_id)

    def get(self, job_id: int) -> Job | None:
        row = self.conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _row(row)

    def get_required(self, job_id: int) -> Job:
        job = self.get(job_id)
        if job is None:
            raise KeyError(job_id)
        return job

    def all(self) -> list[Job]:
        return [_row(r) for r in self.conn.execute("SELECT * FROM jobs ORDER BY id")]

    def page(self, after: int, limit: int) -> list[Job]:
        rows = self.conn.execute("SELECT * FROM jobs WHERE id > ? ORDER BY id LIMIT ?",
                                 (after, limit))
        return [_row(r) for r in rows]

    def in_states(self, *states: str) -> list[Job]:
        marks = ", ".join("?" for _ in states)
        rows = self.conn.execute(f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY id",
                                 states)
        return [_row(r) for r in rows]

    def first_pending(self) -> Job | None:
        row = self.conn.execute(
            "SELECT * FROM jobs WHERE state = 'pending' ORDER BY id LIMIT 1").fetchone()
        return None if row is None else _row(row)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATES, 0)
        for state, n in self.conn.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state"):
            counts[state] = n
        return counts
