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

What a job's row holds and how it is read back is job.py's (pure); the schema and its
migrations are schema.py's.
"""

from __future__ import annotations

import json
import os
import sqlite3
from typing import Any

from tether.agent import schema
from tether.agent.job import (
    BOOLS,
    CGROUP,
    FACTS,
    IDENTITY,
    JSON_COLS,
    SCHED,
    SELECT,
    STATES,
    Job,
    Queued,
    from_row,
)
from tether.shared.errors import NotFound, Unavailable

#: SQLite's result codes for a full disk or database (sqlite3.h)
_FULL_CODES = (13, 13 | (1 << 8))  # SQLITE_FULL; SQLITE_IOERR is 10, handled by message


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
            schema.check(path, found)
            self.conn.execute("PRAGMA journal_mode=WAL")
            # commits reach the WAL (the page cache) at once; ``sync`` makes them durable
            self.conn.execute("PRAGMA synchronous=NORMAL")
            schema.migrate(self, path, found)
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
        for col in JSON_COLS:
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
        """Write a job's scheduling facts (``SCHED``) into job_sched."""
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
        for col in JSON_COLS:
            if col in fields:
                fields[col] = json.dumps(fields[col])
        sched = {k: fields.pop(k) for k in SCHED if k in fields}
        facts = {k: fields.pop(k) for k in FACTS if k in fields}
        if "supervisor_boot" in facts or "supervisor_session" in facts:
            facts["supervisor_ticks"] = fields.get("supervisor_ticks")
        cgroup = {k: fields.pop(k) for k in CGROUP if k in fields}
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
        ident = IDENTITY & fields.keys()
        if ident and ident != IDENTITY:
            # which identity a re-read shows depends on job_facts' own ticks (``from_row``)
            return self.get_required(job.id)
        for name in BOOLS:
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
        row = self.conn.execute(f"{SELECT} WHERE jobs.id = ?", (job_id,)).fetchone()
        return None if row is None else from_row(row)

    def get_required(self, job_id: int) -> Job:
        job = self.get(job_id)
        if job is None:
            raise KeyError(job_id)
        return job

    def all(self) -> list[Job]:
        return [from_row(r) for r in self.conn.execute(f"{SELECT} ORDER BY jobs.id")]

    def page(self, after: int, limit: int) -> list[Job]:
        rows = self.conn.execute(f"{SELECT} WHERE jobs.id > ? ORDER BY jobs.id LIMIT ?",
                                 (after, limit))
        return [from_row(r) for r in rows]

    def in_states(self, *states: str) -> list[Job]:
        marks = ", ".join("?" for _ in states)
        rows = self.conn.execute(f"{SELECT} WHERE jobs.state IN ({marks}) ORDER BY jobs.id",
                                 states)
        return [from_row(r) for r in rows]

    def first_pending(self) -> Job | None:
        row = self.conn.execute(
            f"{SELECT} WHERE jobs.state = 'pending' ORDER BY jobs.id LIMIT 1").fetchone()
        return None if row is None else from_row(row)

    def queue(self, after: int, limit: int, uid: int | None | bool = True) -> list[Queued]:
        """Up to ``limit`` pending jobs after id ``after``, in id order (of one user's, ``uid``:
        None for jobs recorded before users existed; True: everyone's), with only what the
        scheduler reads (a pass over hundreds of jobs decodes no environments)."""
        mine = "" if uid is True else "AND jobs.uid IS ? "
        rows = self.conn.execute(
            "SELECT jobs.id, jobs.cpus_per_task * jobs.ntasks, jobs.gpus_req, jobs.memory_mb, "
            "s.time_limit, COALESCE(s.held, 0), s.dependency, s.array_id, s.array_max, "
            "s.begin_at "
            "FROM jobs LEFT JOIN job_sched s ON s.id = jobs.id "
            f"WHERE jobs.state = 'pending' {mine}AND jobs.id > ? ORDER BY jobs.id LIMIT ?",
            (after, limit) if uid is True else (uid, after, limit))
        return [Queued(r[0], r[1], r[2], r[3], r[4], bool(r[5]),
                       [(k, j) for k, j in json.loads(r[6] or "[]")], r[7], r[8], r[9])
                for r in rows]

    def pending_users(self) -> list[tuple[int | None, int, int]]:
        """Every user with pending jobs: (uid, how many, the first one's id); through the index
        of pending jobs by user (schema 10)."""
        return [(r[0], int(r[1]), int(r[2])) for r in self.conn.execute(
            "SELECT uid, COUNT(*), MIN(id) FROM jobs WHERE state = 'pending' GROUP BY uid")]

    def count_of(self, uid: int | None, *states: str) -> int:
        """How many jobs of ``uid`` are in ``states``."""
        marks = ", ".join("?" for _ in states)
        row = self.conn.execute(f"SELECT COUNT(*) FROM jobs WHERE uid IS ? AND state IN "
                                f"({marks})", (uid, *states)).fetchone()
        return int(row[0])

    def states_of(self, ids: set[int], table: str = "jobs", key: str = "id") -> dict[int, str]:
        """The states of these jobs (unknown ones left out), 500 at a time; in ``table``
        (``job_acct``, keyed by ``job``: the accounting history), a name of ours, never input."""
        out: dict[int, str] = {}
        todo = sorted(ids)
        for i in range(0, len(todo), 500):
            chunk = todo[i:i + 500]
            marks = ", ".join("?" for _ in chunk)
            for job_id, state in self.conn.execute(
                    f"SELECT {key}, state FROM {table} WHERE {key} IN ({marks})", chunk):
                out[int(job_id)] = str(state)
        return out

    def array_elements(self, array_id: int) -> list[Job]:
        rows = self.conn.execute(f"{SELECT} WHERE s.array_id = ? ORDER BY jobs.id",
                                 (array_id,))
        return [from_row(r) for r in rows]

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
        row = self.conn.execute(f"{SELECT} WHERE s.array_id = ? AND s.array_index = ?",
                                (array_id, index)).fetchone()
        return None if row is None else from_row(row)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATES, 0)
        for state, n in self.conn.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state"):
            counts[state] = n
        return counts
