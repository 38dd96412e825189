"""What one user may keep in the agent's state directory (issue 27, point 4), and the purge of
ended jobs from the jobs table (I/O).

Bounds, per user (root's and the agent's user's own jobs are not limited):

- pending jobs: ``agent --max-queued-per-user`` (default 1000; each array element counts);
  a submission past it is refused (``limit``), before and again as it is recorded;
- her job records in the jobs table (command line, environment, name and paths, the bytes
  that a submission decides): ``--max-user-records-mb`` (default 64). Past it her own oldest
  ended jobs are purged to make room, and if that is not enough the submission is refused;
- ended jobs: each stays in the jobs table (``list``, ``show``, ``wait``) ``--keep-ended``
  days (default 7), and at most ``--keep-ended-count`` (default 1000) of hers, the most recent,
  are kept; the others are purged (``Purge``, every ``PURGE_EVERY`` seconds, ``BATCH`` at a
  time, each batch one transaction).

Purging an ended job deletes its rows from ``jobs``, ``job_facts``, ``job_umask``,
``job_sched`` and ``job_cgroup`` (``job_batch``'s row goes with the last job of its batch, by
its trigger: batch.py). What stays is its row in the accounting history, ``job_acct``
(acct.py: written when the job ended, in the same transaction as its final state; a purged job
that has none gets one first, without usage), which ``tether acct`` reads and dependencies fall
back to (depends.py). An array is purged whole, once every element ended and none is kept. A
full disk loses nothing: a batch is one transaction, refused whole (``StoreFull``) and tried
again at the next round. A cluster's member purges nothing (its local rows carry results owed
to the cluster: cluster_local.py).

The bytes each user's records take (``Tally``) are counted once, at the first submission,
from the table, then kept as jobs are recorded and purged.

The supervisors' log (``supervisors.log``, which any user can make a supervisor write to: the
bad requests and refusals each door logs, ~10 lines a second at most) is kept under
``LOG_MAX``: past it, it is copied to ``supervisors.log.1`` (replacing the copy before) and
emptied in place (supervisors append to it through fds of their own: a rename would not
stop them), looked at every ``LOG_CHECK`` seconds (``rotate_log``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tether.agent import acct
from tether.agent.job import FINAL
from tether.shared import stamps
from tether.shared.errors import LimitError, TetherError
from tether.shared.timers import Timer

if TYPE_CHECKING:
    from tether.agent.db import Store
    from tether.agent.view import RetentionAgent as Agent

log = logging.getLogger("tether.agent")

#: seconds between two purges of ended jobs (sooner while a purge leaves more)
PURGE_EVERY = 60.0
#: ended jobs one purge transaction deletes at most
BATCH = 500
#: seconds after a job ends that a purge runs, at most
SOON = 1.0
#: the most the supervisors' log holds before it is rotated, and how often it is looked at
LOG_MAX = 64 << 20
LOG_CHECK = 5.0

_FINAL_MARKS = ", ".join("?" for _ in FINAL)
#: a job row's bytes that its submission decided (CAST: bytes, not characters)
_SIZE = ("length(CAST(jobs.command AS BLOB)) + length(CAST(jobs.env AS BLOB)) + "
         "length(CAST(jobs.name AS BLOB)) + length(CAST(jobs.output AS BLOB)) + "
         "length(CAST(jobs.error AS BLOB)) + length(CAST(jobs.workdir AS BLOB))")


def limited(uid: int | None) -> bool:
    """Do the per-user bounds hold for the jobs of ``uid``?"""
    return uid is not None and uid not in (0, os.getuid())


def record_size(command: list[str], env: dict[str, str], name: str, workdir: str,
                names: Iterable[tuple[str, str]]) -> int:
    """The bytes the rows of one submission take by ``_SIZE`` (one per element's names)."""
    each = (len(json.dumps(command).encode()) + len(json.dumps(env).encode())
            + len(name.encode()) + len(workdir.encode()))
    return sum(each + len(out.encode()) + len(err.encode()) for out, err in names)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class Tally:
    """Each user's bytes of job records in the jobs table."""

    def __init__(self) -> None:
        self.by_uid: dict[int | None, int] | None = None

    def of(self, db: Store, uid: int | None) -> int:
        if self.by_uid is None:
            self.by_uid = {row[0]: int(row[1] or 0) for row in db.conn.execute(
                f"SELECT uid, SUM({_SIZE}) FROM jobs GROUP BY uid")}
        return self.by_uid.get(uid, 0)

    def add(self, uid: int | None, size: int) -> None:
        if self.by_uid is not None:
            self.by_uid[uid] = max(0, self.by_uid.get(uid, 0) + size)


def check_queued(agent: Agent, uid: int | None, count: int) -> None:
    """Refuse (``LimitError``) ``count`` more pending jobs of ``uid`` past her limit."""
    most = agent.cfg.limits.max_queued
    if not most or not limited(uid):
        return
    have = agent.db.count_of(uid, "pending")
    if have + count > most:
        what = f"{count} more" if count > 1 else "one more"
        raise LimitError(
            f"uid {uid} has {have} jobs pending: {what} would pass the {most} one user may "
            "have (agent --max-queued-per-user; Slurm's QOSMaxSubmitJobPerUserLimit); the job "
            "was not submitted")


def admit(agent: Agent, uid: int | None, name: str | None, count: int, size: int) -> None:
    """In the transaction that records a submission (``count`` jobs, ``size`` bytes) of
    ``uid``: refuse it past her pending limit or, once her oldest ended jobs are purged to
    make room, past her share of the state directory. Counts it in her share."""
    who = f"{name} (uid {uid})" if name else f"uid {uid}"
    check_queued(agent, uid, count)
    if not limited(uid):
        agent.tally.add(uid, size)
        return
    quota = agent.cfg.limits.max_records_mb << 20
    have = agent.tally.of(agent.db, uid)
    if have + size > quota and agent.cluster is None:
        freed = purge_own(agent, uid, have + size - quota)
        have -= freed
    if have + size > quota:
        raise LimitError(
            f"the job records of {who} take {_mib(have)} of the state directory: "
            f"{_mib(size)} more would pass the {agent.cfg.limits.max_records_mb} MiB one user "
            "may have (agent --max-user-records-mb), even with her ended jobs purged; cancel "
            "some of her jobs or wait for them to end; the job was not submitted")
    agent.tally.add(uid, size)


def purge_own(agent: Agent, uid: int | None, need: int) -> int:
    """Purge ``uid``'s oldest ended jobs (whole arrays, none another job still needs) until
    ``need`` bytes are freed or none is left (in the caller's transaction); the bytes freed."""
    db = agent.db
    rows = db.conn.execute(
        f"SELECT jobs.id, s.array_id, {_SIZE} FROM jobs LEFT JOIN job_sched s ON s.id = jobs.id "
        f"WHERE jobs.uid IS ? AND jobs.state IN ({_FINAL_MARKS}) ORDER BY jobs.ended_at, jobs.id",
        (uid, *FINAL)).fetchall()
    busy = _busy_arrays(db)
    ids: list[int] = []
    freed = 0
    arrays: set[int] = set()
    for job_id, array_id, size in rows:
        if freed >= need:
            break
        if array_id is not None:
            if array_id in busy or array_id in arrays:
                continue
            arrays.add(array_id)
            members = db.conn.execute(
                f"SELECT jobs.id, {_SIZE} FROM jobs JOIN job_sched s ON s.id = jobs.id "
                "WHERE s.array_id = ?", (array_id,)).fetchall()
            ids += [m[0] for m in members]
            freed += sum(int(m[1] or 0) for m in members)
            continue
        ids.append(job_id)
        freed += int(size or 0)
    if ids:
        _delete(db, ids)
        agent.tally.add(uid, -freed)
        log.info("purged %d ended jobs of uid %s to make room for her submission (%s)",
                 len(ids), uid, _mib(freed))
    return freed


def _busy_arrays(db: Store) -> set[int]:
    """The arrays with an element not ended: none of theirs is purged."""
    return {int(r[0]) for r in db.conn.execute(
        "SELECT DISTINCT s.array_id FROM job_sched s JOIN jobs ON jobs.id = s.id WHERE "
        f"s.array_id IS NOT NULL AND jobs.state NOT IN ({_FINAL_MARKS})", FINAL)}


def _delete(db: Store, ids: list[int]) -> None:
    """Delete these ended jobs from the live tables, their accounting rows kept (written now
    for any that has none). In the caller's transaction."""
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        marks = ", ".join("?" for _ in chunk)
        have = {int(r[0]) for r in db.conn.execute(
            f"SELECT job FROM job_acct WHERE job IN ({marks})", chunk)}
        for job_id in chunk:
            if job_id not in have:  # ended before the history, and not backfilled: write it
                job = db.get(job_id)
                if job is not None:
                    db._exec(f"INSERT OR IGNORE INTO job_acct ({', '.join(acct.COLUMNS)}) "
                             f"VALUES ({', '.join('?' for _ in acct.COLUMNS)})",
                             acct.row_of(job, None))
        for table, key in (("job_facts", "job"), ("job_umask", "id"), ("job_sched", "id"),
                           ("job_cgroup", "job"), ("jobs", "id")):
            db._exec(f"DELETE FROM {table} WHERE {key} IN ({marks})", tuple(chunk))


class Purge:
    """The periodic purge of ended jobs past their retention."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.stopped = False
        #: purged so far (status)
        self.purged = 0
        self.timer: Timer | None = None
        #: when the next kept ended job passes --keep-ended (epoch seconds), if known
        self.expiry: float | None = None

    def start(self) -> None:
        self.at(time.monotonic() + SOON)
        self.watch_log()

    def stop(self) -> None:
        self.stopped = True
        if self.timer is not None:
            self.timer.cancel()

    def at(self, when: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.agent.timers.at(when, self.tick)

    def soon(self) -> None:
        """A job ended: purge within ``SOON`` seconds (its user may be over her count)."""
        if not self.stopped and self.timer is not None and \
                self.timer.when > time.monotonic() + SOON:
            self.at(time.monotonic() + SOON)

    def tick(self) -> None:
        self.timer = None
        if self.stopped:
            return
        again = PURGE_EVERY
        try:
            now = time.time()
            if self.agent.cluster is None and self.run(now) >= BATCH:
                again = 0.1  # more to purge: soon, a batch per turn of the loop
            elif self.expiry is not None:  # the next ended job to pass its days: then
                again = min(again, max(SOON, self.expiry - now + 0.1))
        except TetherError as exc:  # a full disk: nothing was deleted; the next round tries
            log.warning("purging ended jobs: %s; trying again in %.0f s", exc, again)
        except Exception:
            log.exception("purging ended jobs")
        self.at(time.monotonic() + again)

    def due(self, now: float) -> list[tuple[int, int | None, int]]:
        """Up to ``BATCH`` ended jobs past their retention: (id, uid, bytes)."""
        lim = self.agent.cfg.limits
        cutoff = stamps.stamp(now - lim.keep_ended_days * 86400.0)
        db = self.agent.db
        rows = db.conn.execute(
            "SELECT jobs.id, jobs.uid, jobs.ended_at, s.array_id FROM jobs LEFT JOIN job_sched "
            f"s ON s.id = jobs.id WHERE jobs.state IN ({_FINAL_MARKS}) "
            "ORDER BY jobs.uid, jobs.ended_at DESC, jobs.id DESC", FINAL).fetchall()
        kept_arrays = _busy_arrays(db)
        seen: dict[int | None, int] = {}
        out: list[tuple[int, int | None, int | None]] = []
        oldest: str | None = None  # of those kept
        for job_id, uid, ended_at, array_id in rows:
            n = seen[uid] = seen.get(uid, 0) + 1
            old = ended_at is None or ended_at < cutoff
            if n > lim.keep_ended_count or old:
                out.append((job_id, uid, array_id))
                continue
            oldest = ended_at if oldest is None else min(oldest, ended_at)
            if array_id is not None:
                kept_arrays.add(array_id)
        ended = stamps.epoch(oldest)
        self.expiry = None if ended is None else ended + lim.keep_ended_days * 86400.0
        # whole arrays: each unit is a job, or every element of an array (all chosen)
        units: dict[tuple[str, int], list[tuple[int, int | None]]] = {}
        for j, u, a in out:
            if a is None or a not in kept_arrays:
                units.setdefault(("array", a) if a is not None else ("job", j), []).append(
                    (j, u))
        chosen: list[tuple[int, int | None]] = []
        for members in units.values():
            if len(chosen) >= BATCH:
                break
            chosen += members
        if not chosen:
            return []
        sizes: dict[int, int] = {}
        ids = [j for j, _ in chosen]
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            marks = ", ".join("?" for _ in chunk)
            for job_id, size in db.conn.execute(
                    f"SELECT jobs.id, {_SIZE} FROM jobs WHERE jobs.id IN ({marks})", chunk):
                sizes[int(job_id)] = int(size or 0)
        return [(j, u, sizes.get(j, 0)) for j, u in chosen]

    def run(self, now: float) -> int:
        """Purge one batch; how many were purged."""
        chosen = self.due(now)
        if not chosen:
            return 0
        db = self.agent.db
        db.begin()
        try:
            _delete(db, [j for j, _, _ in chosen])
            db.commit()
        except BaseException:
            db.rollback()
            raise
        for _, uid, size in chosen:
            self.agent.tally.add(uid, -size)
        self.purged += len(chosen)
        log.info("purged %d ended jobs past their retention (--keep-ended %g days, "
                 "--keep-ended-count %d); the accounting history keeps them", len(chosen),
                 self.agent.cfg.limits.keep_ended_days, self.agent.cfg.limits.keep_ended_count)
        return len(chosen)

    def status(self) -> dict[str, Any]:
        return {"purged": self.purged}

    def watch_log(self) -> None:
        """Keep the supervisors' log under ``LOG_MAX`` (``rotate_log``), every ``LOG_CHECK``
        seconds."""
        if self.stopped:
            return
        try:
            rotate_log(self.agent.dir_fd, LOG_MAX)
        except OSError as exc:
            log.warning("cannot rotate supervisors.log: %s", exc)
        self.agent.timers.at(time.monotonic() + LOG_CHECK, self.watch_log)


def rotate_log(dir_fd: int, most: int, name: str = "supervisors.log") -> bool:
    """If ``name`` in the state directory holds more than ``most`` bytes: copy it to
    ``NAME.1`` and empty it in place (its writers append: they go on at its new end). A copy
    that fails (a full disk) is given up, and the log emptied all the same: it is bounded
    either way. True if it was emptied."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size <= most:
            return False
        tmp = f"{name}.1.tmp"
        try:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                          | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
            try:
                offset, size = 0, st.st_size
                while offset < size:
                    sent = os.copy_file_range(fd, out, size - offset, offset)
                    if sent <= 0:
                        break
                    offset += sent
            finally:
                os.close(out)
            os.rename(tmp, f"{name}.1", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            log.warning("%s is over %d MiB and cannot be copied (%s): emptied without a copy",
                        name, most >> 20, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
        os.ftruncate(fd, 0)
        return True
    finally:
        os.close(fd)
