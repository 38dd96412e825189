"""The database's schema and its versions: the ordered migrations, and the refusal of a schema
newer than this build's.

Apart from the Store (db.py) because it is the history of the tables rather than their use:
it grows by one migration per schema change and runs once per start, while the Store's reads
and writes run on every turn of the loop.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import tether
from tether.agent import acct, batch

if TYPE_CHECKING:
    from tether.agent.store_api import StoreApi as Store

log = logging.getLogger("tether.agent")

# ---- schema versions ------------------------------------------------------------------------
#
# The schema's version lives in the database itself (``PRAGMA user_version``). ``MIGRATIONS`` is
# ordered: migration N (1-based) turns a version N-1 database into version N, and
# ``SCHEMA_VERSION`` is simply how many there are. A fresh database runs them all, in order.
#
# How to add a migration (say, a column):
#   1. append a new ``Migration`` to MIGRATIONS, never edit or reorder an existing one (a node may
#      be at any earlier version); its SQL must work on exactly the previous version's schema;
#   2. give the new field a default in ``Job`` (and ``public()`` if the CLI shows it), and
#      read and write it in job.py's table map;
#   3. bump ``tether.__version__`` and add a line to the release notes in docs/operations.md:
#      an agent older than this schema refuses to start on it, so that release can no longer be
#      rolled back to without restoring the backup taken before the migration;
#   4. add the version to the refusal test in tests/integration/test_schema.py if it matters.
# Each migration and its user_version bump commit in one transaction, so a crash mid-way
# leaves the database at the previous version, whole. Before migrating a database that already
# holds jobs, the agent copies it to ``<db>.v<old version>`` (an operator's way back).

_BASELINE = """
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
    cancel_requested INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, id);
"""

#: Columns that builds before 0.1.0 added in place without a version (0.1.0's own database is
#: unversioned too: ``user_version`` 0 with every one of them).
_PRE_RELEASE_COLUMNS = {"pmi": "TEXT NOT NULL DEFAULT 'none'", "user": "TEXT",
                        "uid": "INTEGER", "gid": "INTEGER"}


def _baseline(conn: sqlite3.Connection) -> None:
    """Version 1: the schema of release 0.1.0, from nothing or from any unversioned database."""
    for stmt in _BASELINE.split(";"):
        if stmt.strip():
            conn.execute(stmt)
    have = {row[1] for row in conn.execute("PRAGMA table_info(jobs)")}
    for column, ddl in _PRE_RELEASE_COLUMNS.items():
        if column not in have:
            conn.execute(f"ALTER TABLE jobs ADD COLUMN {column} {ddl}")


@dataclass(frozen=True)
class Migration:
    #: what it changes, for the log and the release notes
    what: str
    apply: Callable[[sqlite3.Connection], None]


def sql(*statements: str) -> Callable[[sqlite3.Connection], None]:
    """A migration made of plain SQL statements, run in order."""
    def run(conn: sqlite3.Connection) -> None:
        for stmt in statements:
            conn.execute(stmt)
    return run


MIGRATIONS: list[Migration] = [
    Migration("the jobs table of release 0.1.0", _baseline),
    # A table of its own, not columns: release 0.1.0's agent reads ``SELECT * FROM jobs`` into
    # a dataclass and would refuse an unknown column, and rolling back to it must keep working.
    Migration("job_facts: the supervisor's boot id and session (to find a lost step's "
              "processes without its manifest) and core_dumped",
              sql("CREATE TABLE IF NOT EXISTS job_facts (job INTEGER PRIMARY KEY, "
                  "supervisor_ticks INTEGER, supervisor_boot TEXT, supervisor_session INTEGER, "
                  "core_dumped INTEGER NOT NULL DEFAULT 0)")),
    # Beside the jobs table, not in it: release 0.1.0's agent reads every column of ``jobs``
    # into its Job, so a new column there would stop it from running after a rollback.
    Migration("the submitter's umask of each job (issue 7), in a table of its own",
              sql("CREATE TABLE IF NOT EXISTS job_umask (id INTEGER PRIMARY KEY, "
                  "umask INTEGER NOT NULL)")),
    # Issue 13's scheduling facts, beside ``jobs`` for the same reason: the time limit
    # (seconds), a user hold, the dependencies (JSON: [[kind, job id], ...]) and the array an
    # element belongs to (array_id: its first element's id; array_max: Slurm's %MAX).
    Migration("job_sched: time limits, holds, dependencies and arrays (issue 13), in a table "
              "of its own",
              sql("CREATE TABLE IF NOT EXISTS job_sched (id INTEGER PRIMARY KEY, "
                  "time_limit REAL, held INTEGER NOT NULL DEFAULT 0, dependency TEXT, "
                  "array_id INTEGER, array_index INTEGER, array_max INTEGER)",
                  "CREATE INDEX IF NOT EXISTS job_sched_array ON job_sched(array_id)")),
    # Beside the jobs table too (issue 9). A job is suspended while suspended_at is set (the
    # wall-clock second it was frozen); its state column stays "running", which is what an
    # agent rolled back to an older release understands.
    Migration("job_cgroup: whether the OOM killer ended the job, and its suspension "
              "(since when, seconds in all)",
              sql("CREATE TABLE IF NOT EXISTS job_cgroup (job INTEGER PRIMARY KEY, "
                  "oom INTEGER NOT NULL DEFAULT 0, suspended_at REAL, "
                  "suspended_seconds REAL NOT NULL DEFAULT 0)")),
    Migration("job_sched.begin_at: when a job may start at the earliest (submit --begin, "
              "epoch seconds)",
              sql("ALTER TABLE job_sched ADD COLUMN begin_at REAL")),
    Migration("job_facts.pmi_unused: a --pmi job none of whose ranks spoke PMI (issue 27)",
              sql("ALTER TABLE job_facts ADD COLUMN pmi_unused INTEGER NOT NULL DEFAULT 0")),
    # Issue 28: a batch script kept at submit (the copy is what runs) and --export-slurm-env,
    # one row for a job or for all the elements of an array (ids job .. job + elements - 1);
    # the row goes with the last of its jobs (agent/batch.py).
    Migration("job_batch: the batch script kept at submit and --export-slurm-env (issue 28)",
              lambda conn: batch.create(conn)),
    # Issue 28: the accounting history, one compact row per ended job, apart from the jobs
    # table so that purging ended jobs leaves it (agent/acct.py); the jobs that ended before
    # it are written into it as they are (no usage: nothing measured it).
    Migration("job_acct: the accounting history of ended jobs (issue 28; tether acct)",
              lambda conn: acct.create(conn)),
    # Issue 27: each user's pending jobs in queue order (the per-user limits and the fair-share
    # queue read them by user), and each user's jobs (the per-user bounds on records).
    Migration("indexes of the jobs by user (issue 27: per-user limits and fair share)",
              sql("CREATE INDEX IF NOT EXISTS jobs_state_user ON jobs(state, uid, id)",
                  "CREATE INDEX IF NOT EXISTS jobs_user ON jobs(uid, state)")),
]

SCHEMA_VERSION = len(MIGRATIONS)


class SchemaError(Exception):
    """The database is of a schema this build does not know; nothing was changed."""


def check(path: str, found: int) -> None:
    """Refuse a database whose schema (``found``) is newer than this build's; read before
    anything is written, so such a schema is left untouched."""
    if found > SCHEMA_VERSION:
        raise SchemaError(
            f"database {path} has schema version {found}, newer than this build's "
            f"{SCHEMA_VERSION} (tether {tether.__version__}); refusing to start (run "
            "the newer release, or restore the backup taken before it migrated)")


def migrate(store: Store, path: str, found: int) -> None:
    """Run every migration after ``found`` on the store, each in its own transaction."""
    if found == SCHEMA_VERSION:
        return
    conn = store.conn
    has_jobs = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'jobs'").fetchone()
    if has_jobs:
        backup = f"{path}.v{found}"
        if not os.path.exists(backup):
            dest = sqlite3.connect(backup)
            try:
                conn.backup(dest)
            finally:
                dest.close()
            os.chmod(backup, 0o600)
    for number in range(found + 1, SCHEMA_VERSION + 1):
        step = MIGRATIONS[number - 1]
        store.begin()
        try:
            step.apply(conn)
            # PRAGMA does not take parameters; number is an int we computed
            conn.execute(f"PRAGMA user_version = {number}")
            store.commit()
        except BaseException:
            store.rollback()
            raise
        log.info("database %s: schema %d -> %d (%s)", path, number - 1, number, step.what)
