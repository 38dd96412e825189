"""What a submission keeps beside its jobs for their launch (I/O): the batch script copied at
submit (``tether submit job.sh``: the copy is what runs, never the file, which the agent never
reads) and whether the tasks get Slurm's names of their variables (``--export-slurm-env``).

One row per submission: a job's, or an array's for all its elements (their ids are
consecutive: ``job`` .. ``job + elements - 1``), so a thousand elements keep one copy of the
script. A trigger removes the row once the last of those jobs leaves the jobs table (a purge of
ended jobs), whoever deletes them and in whatever order.
"""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING

from tether.agent.job import Job
from tether.shared import batch

if TYPE_CHECKING:
    from tether.agent.store_api import StoreApi as Store

_TABLE = ("CREATE TABLE IF NOT EXISTS job_batch (job INTEGER PRIMARY KEY, "
          "elements INTEGER NOT NULL DEFAULT 1, script BLOB, "
          "slurm_env INTEGER NOT NULL DEFAULT 0)")
_TRIGGER = """
CREATE TRIGGER IF NOT EXISTS job_batch_gone AFTER DELETE ON jobs BEGIN
    DELETE FROM job_batch
    WHERE job = (SELECT MAX(job) FROM job_batch WHERE job <= OLD.id)
      AND OLD.id < job + elements
      AND NOT EXISTS (SELECT 1 FROM jobs
                      WHERE jobs.id >= job_batch.job AND jobs.id < job_batch.job + elements);
END
"""


def create(conn: sqlite3.Connection) -> None:
    """The table and its trigger (schema 8)."""
    conn.execute(_TABLE)
    conn.execute(_TRIGGER)


def record(db: Store, first: int, elements: int, script: bytes | None,
           slurm_env: bool) -> None:
    """Keep a submission's script and flag, in the caller's transaction."""
    if script is not None and len(script) > batch.MAX_SCRIPT:  # the request was checked
        raise ValueError("script too long")
    db._exec("INSERT OR REPLACE INTO job_batch (job, elements, script, slurm_env) "
             "VALUES (?, ?, ?, ?)", (first, elements, script, int(slurm_env)))


def of(db: Store, job: Job) -> tuple[bytes | None, bool]:
    """The script ``job`` runs (None: its command is a program) and its ``--export-slurm-env``."""
    key = job.array_id if job.array_id is not None else job.id
    row = db._exec("SELECT script, slurm_env FROM job_batch WHERE job = ?", (key,)).fetchone()
    if row is None:
        return None, False
    return (None if row[0] is None else bytes(row[0])), bool(row[1])
