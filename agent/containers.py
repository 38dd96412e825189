"""What a container submission keeps beside its jobs for their launch (I/O): the checked
``container`` argument (shared/container_spec.py: root filesystem, the image's environment,
mounts, runtime) as JSON.

One row per submission: a job's, or an array's for all its elements (consecutive ids ``job``
.. ``job + elements - 1``), removed by a trigger once the last of those jobs leaves the jobs
table, as batch.py's rows are.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any, Protocol

from tether.agent.job import Job


class Store(Protocol):
    """What of the agent's store these use (not agent.db's own class: the schema imports
    this module, and the store the schema)."""

    def _exec(self, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Cursor: ...

_TABLE = ("CREATE TABLE IF NOT EXISTS job_container (job INTEGER PRIMARY KEY, "
          "elements INTEGER NOT NULL DEFAULT 1, spec TEXT NOT NULL)")
_TRIGGER = """
CREATE TRIGGER IF NOT EXISTS job_container_gone AFTER DELETE ON jobs BEGIN
    DELETE FROM job_container
    WHERE job = (SELECT MAX(job) FROM job_container WHERE job <= OLD.id)
      AND OLD.id < job + elements
      AND NOT EXISTS (SELECT 1 FROM jobs
                      WHERE jobs.id >= job_container.job
                        AND jobs.id < job_container.job + elements);
END
"""


def create(conn: sqlite3.Connection) -> None:
    """The table and its trigger (schema 11)."""
    conn.execute(_TABLE)
    conn.execute(_TRIGGER)


def record(db: Store, first: int, elements: int, container: dict[str, Any]) -> None:
    """Keep a submission's container (checked by the request's handler), in the caller's
    transaction."""
    db._exec("INSERT OR REPLACE INTO job_container (job, elements, spec) VALUES (?, ?, ?)",
             (first, elements, json.dumps(container, separators=(",", ":"))))


def of(db: Store, job: Job) -> dict[str, Any] | None:
    """The container ``job`` runs in, or None."""
    key = job.array_id if job.array_id is not None else job.id
    row = db._exec("SELECT spec FROM job_container WHERE job = ?", (key,)).fetchone()
    if row is None:
        return None
    value = json.loads(row[0])
    return value if isinstance(value, dict) else None
