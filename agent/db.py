"""The agent's durable state: SQLite in WAL mode, made durable by group commit (I/O).

It holds intent (what the agent asked for: the job, its attempt, its allocation) and history
(what supervisors told it: pids, results). It never holds a guess about a running step.

Group commit. Each write is its own transaction, as before (so a full disk fails that write
alone), but a commit does not fsync (``synchronous=NORMAL``: it is in the kernel's page cache,
which survives the agent's death). At the end of each turn of its loop the agent has the WAL
fsync'd (``fsync_wal``, on its sync thread, agent/syncer.py) before anything of that turn is
told to anyone or done to a process (group_commit.py holds those until then): one fsync makes every
commit before it durable against a power cut. Checkpoints sync the WAL and the database as
before.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import tether
from tether.agent.ledger import Allocation
from tether.shared import stamps
from tether.shared.errors import NotFound, Unavailable

#: SQLite's result codes for a full disk or database (sqlite3.h)
_FULL_CODES = (13, 13 | (1 << 8))  # SQLITE_FULL; SQLITE_IOERR is 10, handled by message

log = logging.getLogger("tether.agent")

ACTIVE = ("starting", "running")
FINAL = ("completed", "failed", "cancelled", "lost", "timeout")
STATES = ("pending", *ACTIVE, *FINAL)

# ---- schema versions ------------------------------------------------------------------------
#
# The schema's version lives in the database itself (``PRAGMA user_version``). ``MIGRATIONS`` is
# ordered: migration N (1-based) turns a version N-1 database into version N, and
# ``SCHEMA_VERSION`` is simply how many there are. A fresh database runs them all, in order.
#
# How to add a migration (say, a column):
#   1. append a new ``Migration`` to MIGRATIONS, never edit or reorder an existing one (a node may
#      be at any earlier version); its SQL must work on exactly the previous version's schema;
#   2. give the new field a default in ``Job`` (and ``public()`` if the CLI shows it);
#   3. bump ``tether.__version__`` and add a line to the release notes in docs/operations.md:
#      an agent older than this schema refuses to start on it, so that release can no longer be
#      rolled back to without restoring the backup taken before the migration;
#   4. add the version to the refusal test in tests/test_schema.py if it matters.
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
]

#: the fields of Job kept in job_facts rather than jobs
_FACTS = ("supervisor_boot", "supervisor_session", "core_dumped")
#: the fields of Job kept in job_sched
_SCHED = ("time_limit", "held", "dependency", "array_id", "array_index", "array_max",
          "begin_at")
#: the fields of Job kept in job_cgroup
_CGROUP = ("oom", "suspended_at", "suspended_seconds")
#: the columns of ``jobs`` a Job is read from, in the order ``_row`` takes them
_JOBS_COLUMNS = ("id", "name", "command", "state", "attempt", "exit_code", "signal", "reason",
                 "cpus_per_task", "ntasks", "gpus_req", "memory_mb", "cpus", "gpus",
                 "supervisor_pid", "supervisor_ticks", "pids", "output", "error", "workdir",
                 "env", "submitted_at", "started_at", "ended_at", "cancel_requested", "pmi",
                 "user", "uid", "gid")
#: every query reads jobs through this: job_facts' identity counts only while it is of the
#: supervisor the jobs row names (an agent rolled back to 0.1.0 updates jobs alone)
_SELECT = ("SELECT " + ", ".join(f"jobs.{c}" for c in _JOBS_COLUMNS) + ", "
           "f.supervisor_ticks, f.supervisor_boot, f.supervisor_session, "
           "COALESCE(f.core_dumped, 0), s.time_limit, COALESCE(s.held, 0), s.dependency, "
           "s.array_id, s.array_index, s.array_max, s.begin_at, COALESCE(cg.oom, 0), "
           "cg.suspended_at, COALESCE(cg.suspended_seconds, 0) "
           "FROM jobs LEFT JOIN job_facts f ON f.job = jobs.id "
           "LEFT JOIN job_sched s ON s.id = jobs.id "
           "LEFT JOIN job_cgroup cg ON cg.job = jobs.id")

SCHEMA_VERSION = len(MIGRATIONS)


class SchemaError(Exception):
    """The database is of a schema this build does not know; nothing was changed."""


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
    #: the supervisor's boot id and session, recorded before it is claimed (tasks start in that
    #: session): with supervisor_ticks, how a lost step is found when its manifest is unusable
    supervisor_boot: str | None = None
    supervisor_session: int | None = None
    core_dumped: bool = False
    #: seconds the step may run (the supervisor enforces it), None: no limit
    time_limit: float | None = None
    #: held by its user (``submit --hold``, ``tether hold``): not started until released
    held: bool = False
    #: (kind, job id) pairs that must all be satisfied before it starts
    dependency: list[tuple[str, int]] = field(default_factory=list)
    #: an element of an array: the array's id (its first element's), its index, its %MAX
    array_id: int | None = None
    array_index: int | None = None
    array_max: int | None = None
    #: epoch seconds before which it may not start (``submit --begin``), None: at once
    begin_at: float | None = None
    #: why a pending job waits (computed by the scheduler, never stored)
    pending_reason: str | None = None
    #: the OOM killer took a process of the step (its memory limit was exceeded)
    oom: bool = False
    #: wall-clock time (epoch seconds) the job was suspended, while it is
    suspended_at: float | None = None
    #: seconds spent suspended before (not counting the current suspension)
    suspended_seconds: float = 0.0

    @property
    def suspended(self) -> bool:
        return self.suspended_at is not None and self.state == "running"

    def suspended_total(self, now: float) -> float:
        """Seconds suspended in all, the current suspension included."""
        extra = max(0.0, now - self.suspended_at) if self.suspended_at is not None else 0.0
        return round(self.suspended_seconds + extra, 3)

    @property
    def allocation(self) -> Allocation:
        return Allocation(tuple(self.cpus), tuple(self.gpus), self.memory_mb)

    @property
    def final(self) -> bool:
        return self.state in FINAL

    def public(self) -> dict[str, Any]:
        """The job object of the CLI contract."""
        out: dict[str, Any] = {
            "id": self.id, "name": self.name, "command": self.command, "state": self.state,
            "attempt": self.attempt, "exit_code": self.exit_code, "signal": self.signal,
            "reason": self.reason, "cpus": self.cpus, "gpus": self.gpus,
            "memory_mb": self.memory_mb, "ntasks": self.ntasks,
            "cpus_per_task": self.cpus_per_task, "supervisor_pid": self.supervisor_pid,
            "pids": self.pids, "output": self.output, "error": self.error,
            "workdir": self.workdir, "submitted_at": self.submitted_at,
            "started_at": self.started_at, "ended_at": self.ended_at, "pmi": self.pmi,
            "user": self.user, "uid": self.uid, "core_dumped": self.core_dumped,
            "time_limit": self.time_limit, "held": self.held,
            "dependency": [f"{k}:{j}" for k, j in self.dependency],
            "array_id": self.array_id, "array_index": self.array_index,
            "array_max": self.array_max,
            # "suspended" is a state of the job object only: the row says running (db.py)
            "oom": self.oom, **({"state": "suspended"} if self.suspended else {}),
            "suspended_seconds": self.suspended_total(time.time()),
            "begin_at": None if self.begin_at is None else stamps.stamp(self.begin_at),
        }
        if self.state == "pending" and self.pending_reason is not None:
            out["reason"] = self.pending_reason  # Slurm's pending reason, as squeue shows it
        return out


@dataclass(frozen=True, slots=True)
class Queued:
    """A pending job as the scheduler sees it (``Store.queue``)."""

    id: int
    cpus: int
    gpus: int
    memory_mb: int
    time_limit: float | None
    held: bool
    dependency: list[tuple[str, int]]
    array_id: int | None
    array_max: int | None
    begin_at: float | None = None


_JSON_COLS = ("command", "cpus", "gpus", "pids", "env")
#: columns stored as integers that a Job holds as bools
_BOOLS = ("cancel_requested", "core_dumped", "held", "oom")
#: the supervisor's identity: written together (job_facts keeps boot and session only with
#: the ticks they belong to)
_IDENTITY = frozenset({"supervisor_ticks", "supervisor_boot", "supervisor_session"})


def _list(text: str) -> Any:
    return [] if text == "[]" else json.loads(text)


def _row(row: tuple[Any, ...]) -> Job:
    """A row of ``_SELECT`` as a Job: by position (the loop reads a few rows per job)."""
    (job_id, name, command, state, attempt, exit_code, signal, reason, cpus_per_task, ntasks,
     gpus_req, memory_mb, cpus, gpus, supervisor_pid, supervisor_ticks, pids, output, error,
     workdir, env, submitted_at, started_at, ended_at, cancel_requested, pmi, user, uid, gid,
     facts_ticks, supervisor_boot, supervisor_session, core_dumped, time_limit, held,
     dependency, array_id, array_index, array_max, begin_at, oom, suspended_at,
     suspended_seconds) = row
    if facts_ticks != supervisor_ticks:
        supervisor_boot = supervisor_session = None
    return Job(job_id, name, json.loads(command), state, attempt, exit_code, signal, reason,
               cpus_per_task, ntasks, gpus_req, memory_mb, _list(cpus), _list(gpus),
               supervisor_pid, supervisor_ticks, _list(pids), output, error, workdir,
               json.loads(env), submitted_at, started_at, ended_at, bool(cancel_requested),
               pmi, user, uid, gid, supervisor_boot, supervisor_session, bool(core_dumped),
               time_limit, bool(held),
               [tuple(x) for x in json.loads(dependency)] if dependency else [],
               array_id, array_index, array_max, begin_at, None, bool(oom), suspended_at,
               suspended_seconds)


class StoreFull(Unavailable):
    """The state directory has no room for a write: nothing was changed; try again later."""


def _full(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code in _FULL_CODES or "full" in str(exc)


class Store:
    def __init__(self, path: str) -> None:
        self.path = path
        self.wal = f"{path}-wal"
        #: something was committed that ``sync`` has not made durable yet
        self.unsynced = True
        self.dir_synced = False
        self.synced_changes = 0
        #: how many fsyncs ``sync`` did (the status request reports it)
        self.syncs = 0
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        try:
            # read before anything is written: a schema from a newer build is left untouched
            found = self.version()
            if found > SCHEMA_VERSION:
                raise SchemaError(
                    f"database {path} has schema version {found}, newer than this build's "
                    f"{SCHEMA_VERSION} (tether {tether.__version__}); refusing to start (run "
                    "the newer release, or restore the backup taken before it migrated)")
            self.conn.execute("PRAGMA journal_mode=WAL")
            # commits reach the WAL (the page cache) at once; ``sync`` makes them durable
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.migrate(path, found)
            self.sync()
        except BaseException:
            self.conn.close()
            raise

    def sync(self, *, force: bool = False) -> bool:
        """Make every commit so far durable, here and now. False if nothing was committed
        since the last ``sync`` or ``mark_synced`` (unless ``force``)."""
        if not self.dirty and not force:
            return False
        self.mark_synced()
        self.fsync_wal()
        return True

    def mark_synced(self) -> None:
        """Every commit so far is being made durable (by ``fsync_wal``, maybe on another
        thread): ``dirty`` counts from here."""
        self.unsynced = False
        self.synced_changes = self.conn.total_changes

    def fsync_wal(self) -> None:
        """One fsync of the WAL (the directory's too the first time: the file may be new):
        every commit made before the call is durable after it. Thread-safe: no SQLite."""
        try:
            fd = os.open(self.wal, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # no WAL: the commits were checkpointed into the database
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # as SQLite's own sync: the WAL's data and its size, not its times (once the WAL
            # is reused after a checkpoint, no journal commit of the file system is waited for)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        if not self.dir_synced:
            fd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self.dir_synced = True
        self.syncs += 1

    @property
    def dirty(self) -> bool:
        """Something was committed (or is being written) that ``sync`` has not made durable:
        through this class, or straight on ``conn`` (the cluster's tables)."""
        return self.unsynced or self.conn.total_changes != self.synced_changes

    def version(self) -> int:
        row = self.conn.execute("PRAGMA user_version").fetchone()
        return int(row[0])

    def migrate(self, path: str, found: int) -> None:
        """Run every migration after ``found``, each in its own transaction."""
        if found == SCHEMA_VERSION:
            return
        has_jobs = self.conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'jobs'").fetchone()
        if has_jobs:
            backup = f"{path}.v{found}"
            if not os.path.exists(backup):
                dest = sqlite3.connect(backup)
                try:
                    self.conn.backup(dest)
                finally:
                    dest.close()
                os.chmod(backup, 0o600)
        for number in range(found + 1, SCHEMA_VERSION + 1):
            step = MIGRATIONS[number - 1]
            self.begin()
            try:
                step.apply(self.conn)
                # PRAGMA does not take parameters; number is an int we computed
                self.conn.execute(f"PRAGMA user_version = {number}")
                self.commit()
            except BaseException:
                self.rollback()
                raise
            log.info("database %s: schema %d -> %d (%s)", path, number - 1, number, step.what)

    def close(self) -> None:
        self.conn.close()

    def _exec(self, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        """Execute one statement; a full disk becomes ``StoreFull`` (nothing was written)."""
        try:
            cur = self.conn.execute(sql, params)
        except sqlite3.OperationalError as exc:
            if _full(exc):
                raise StoreFull("state directory full: cannot record anything until space "
                                "is freed") from None
            raise
        if not sql.startswith("SELECT"):  # a write, committed now or by COMMIT
            self.unsynced = True
        return cur

    def begin(self) -> None:
        self._exec("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self._exec("COMMIT")

    def rollback(self) -> None:
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")

    def insert(self, **fields: Any) -> int:
        """Record a job; its id (read it back with ``get`` when the row is wanted)."""
        for col in _JSON_COLS:
            if col in fields:
                fields[col] = json.dumps(fields[col])
        cols = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        cur = self._exec(f"INSERT INTO jobs ({cols}) VALUES ({marks})", tuple(fields.values()))
        job_id = cur.lastrowid
        assert job_id is not None
        return job_id

    def set_umask(self, job_id: int, umask: int) -> None:
        self._exec("INSERT OR REPLACE INTO job_umask (id, umask) VALUES (?, ?)", (job_id, umask))

    def set_sched(self, job_id: int, **fields: Any) -> None:
        """Write a job's scheduling facts (``_SCHED``) into job_sched."""
        if "dependency" in fields:
            fields["dependency"] = json.dumps([list(d) for d in fields["dependency"]])
        if "held" in fields:
            fields["held"] = int(bool(fields["held"]))
        cols = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        sets = ", ".join(f"{k} = excluded.{k}" for k in fields)
        self._exec(f"INSERT INTO job_sched (id, {cols}) VALUES (?, {marks}) "
                   f"ON CONFLICT(id) DO UPDATE SET {sets}", (job_id, *fields.values()))

    def umask_of(self, job_id: int) -> int:
        """The submitter's umask (jobs recorded before it was kept: 022)."""
        row = self._exec("SELECT umask FROM job_umask WHERE id = ?", (job_id,)).fetchone()
        return 0o022 if row is None else int(row[0])

    def last_id(self) -> int:
        """The highest id ever given (AUTOINCREMENT never reuses one)."""
        row = self._exec(
            "SELECT COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'jobs'), 0)"
        ).fetchone()
        return int(row[0])

    def update(self, job_id: int, **fields: Any) -> None:
        """Write these fields of a job (across its tables: all or none). Reads nothing back:
        ``change`` gives the job as it now is, where the caller holds it."""
        for col in _JSON_COLS:
            if col in fields:
                fields[col] = json.dumps(fields[col])
        sched = {k: fields.pop(k) for k in _SCHED if k in fields}
        facts = {k: fields.pop(k) for k in _FACTS if k in fields}
        if "supervisor_boot" in facts or "supervisor_session" in facts:
            facts["supervisor_ticks"] = fields.get("supervisor_ticks")
        cgroup = {k: fields.pop(k) for k in _CGROUP if k in fields}
        own = (not self.conn.in_transaction
               and sum(map(bool, (facts, fields, sched, cgroup))) > 1)
        if own:
            self.begin()  # every table or none
        try:
            if sched:
                self.set_sched(job_id, **sched)
            if fields:
                sets = ", ".join(f"{k} = ?" for k in fields)
                self._exec(f"UPDATE jobs SET {sets} WHERE id = ?", (*fields.values(), job_id))
            if facts:
                cols = ", ".join(facts)
                marks = ", ".join("?" for _ in facts)
                sets = ", ".join(f"{k} = excluded.{k}" for k in facts)
                self._exec(f"INSERT INTO job_facts (job, {cols}) VALUES (?, {marks}) "
                           f"ON CONFLICT(job) DO UPDATE SET {sets}", (job_id, *facts.values()))
            if cgroup:
                cols = ", ".join(cgroup)
                marks = ", ".join("?" for _ in cgroup)
                sets = ", ".join(f"{k} = excluded.{k}" for k in cgroup)
                self._exec(f"INSERT INTO job_cgroup (job, {cols}) VALUES (?, {marks}) "
                           f"ON CONFLICT(job) DO UPDATE SET {sets}", (job_id, *cgroup.values()))
            if own:
                self.commit()
        except BaseException:
            if own:
                self.rollback()
            raise

    def change(self, job: Job, **fields: Any) -> Job:
        """``update`` of a job read in this turn of the loop (so the row is as ``job`` says),
        returning the job as ``get`` would now read it, without reading it (a read decodes
        the whole row, the environment too: most of the loop's CPU per job went to them)."""
        self.update(job.id, **fields)
        ident = _IDENTITY & fields.keys()
        if ident and ident != _IDENTITY:
            # which identity a re-read shows depends on job_facts' own ticks (``_row``)
            return self.get_required(job.id)
        for name in _BOOLS:
            if name in fields:
                fields[name] = bool(fields[name])
        if "dependency" in fields:
            fields["dependency"] = [tuple(d) for d in fields["dependency"]]
        for col in ("cpus", "gpus", "pids"):
            if col in fields:
                fields[col] = list(fields[col])
        # dataclasses.replace would call __init__ over Job's 40-odd fields (~35 us, a re-read's
        # worth): a Job is a plain instance, so a copy of its attributes is the same thing
        new = object.__new__(Job)
        new.__dict__.update(job.__dict__, **fields)
        return new

    def get(self, job_id: int) -> Job | None:
        row = self.conn.execute(f"{_SELECT} WHERE jobs.id = ?", (job_id,)).fetchone()
        return None if row is None else _row(row)

    def get_required(self, job_id: int) -> Job:
        job = self.get(job_id)
        if job is None:
            raise KeyError(job_id)
        return job

    def all(self) -> list[Job]:
        return [_row(r) for r in self.conn.execute(f"{_SELECT} ORDER BY jobs.id")]

    def page(self, after: int, limit: int) -> list[Job]:
        rows = self.conn.execute(f"{_SELECT} WHERE jobs.id > ? ORDER BY jobs.id LIMIT ?",
                                 (after, limit))
        return [_row(r) for r in rows]

    def in_states(self, *states: str) -> list[Job]:
        marks = ", ".join("?" for _ in states)
        rows = self.conn.execute(f"{_SELECT} WHERE jobs.state IN ({marks}) ORDER BY jobs.id",
                                 states)
        return [_row(r) for r in rows]

    def first_pending(self) -> Job | None:
        row = self.conn.execute(
            f"{_SELECT} WHERE jobs.state = 'pending' ORDER BY jobs.id LIMIT 1").fetchone()
        return None if row is None else _row(row)

    def queue(self, after: int, limit: int) -> list[Queued]:
        """Up to ``limit`` pending jobs after id ``after``, in queue order, with only what the
        scheduler reads (a pass over hundreds of jobs decodes no environments)."""
        rows = self.conn.execute(
            "SELECT jobs.id, jobs.cpus_per_task * jobs.ntasks, jobs.gpus_req, jobs.memory_mb, "
            "s.time_limit, COALESCE(s.held, 0), s.dependency, s.array_id, s.array_max, "
            "s.begin_at "
            "FROM jobs LEFT JOIN job_sched s ON s.id = jobs.id "
            "WHERE jobs.state = 'pending' AND jobs.id > ? ORDER BY jobs.id LIMIT ?",
            (after, limit))
        return [Queued(r[0], r[1], r[2], r[3], r[4], bool(r[5]),
                       [(k, j) for k, j in json.loads(r[6] or "[]")], r[7], r[8], r[9])
                for r in rows]

    def states_of(self, ids: set[int]) -> dict[int, str]:
        """The states of these jobs (unknown ones left out)."""
        out: dict[int, str] = {}
        todo = sorted(ids)
        for i in range(0, len(todo), 500):
            chunk = todo[i:i + 500]
            marks = ", ".join("?" for _ in chunk)
            for job_id, state in self.conn.execute(
                    f"SELECT id, state FROM jobs WHERE id IN ({marks})", chunk):
                out[int(job_id)] = str(state)
        return out

    def array_elements(self, array_id: int) -> list[Job]:
        rows = self.conn.execute(f"{_SELECT} WHERE s.array_id = ? ORDER BY jobs.id",
                                 (array_id,))
        return [_row(r) for r in rows]

    def suspensions(self) -> dict[int, tuple[float | None, float]]:
        """Every job ever suspended: (suspended since, or None; seconds suspended before)."""
        rows = self._exec("SELECT job, suspended_at, suspended_seconds FROM job_cgroup WHERE "
                          "suspended_at IS NOT NULL OR suspended_seconds > 0")
        return {int(r[0]): (r[1], float(r[2])) for r in rows}

    def ref_ids(self, job_id: int, index: int | None) -> list[int]:
        """The ids ``ID`` (a job, or every element of an array) or ``ID_INDEX`` names;
        NotFound if none."""
        if index is not None:
            rows = self._exec("SELECT id FROM job_sched WHERE array_id = ? AND array_index = ?",
                              (job_id, index)).fetchall()
        else:
            row = self._exec("SELECT jobs.id, s.array_id FROM jobs LEFT JOIN job_sched s "
                             "ON s.id = jobs.id WHERE jobs.id = ?", (job_id,)).fetchone()
            rows = [] if row is None else [(row[0],)]
            if row is not None and row[1] == job_id:
                rows = self._exec("SELECT id FROM job_sched WHERE array_id = ? ORDER BY id",
                                  (job_id,)).fetchall()
        if not rows:
            raise NotFound(f"no job {job_id}" + ("" if index is None else f"_{index}"))
        return [int(r[0]) for r in rows]

    def element(self, array_id: int, index: int) -> Job | None:
        row = self.conn.execute(f"{_SELECT} WHERE s.array_id = ? AND s.array_index = ?",
                                (array_id, index)).fetchone()
        return None if row is None else _row(row)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATES, 0)
        for state, n in self.conn.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state"):
            counts[state] = n
        return counts
