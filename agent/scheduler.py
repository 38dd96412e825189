"""The agent's scheduler pass: the I/O half of ``schedule.py`` (issue 13).

Each pass reads the queue from the database (``Store.queue``: a window of jobs that could
start, in fair-share order, with only the columns planning needs), the predecessors' states,
and the ledger's free counts; hands them with the running jobs' expected ends to the pure
``schedule.plan``; starts what the plan starts (``Agent.start``), cancels the jobs whose
dependency can never be satisfied, and keeps each other examined job's pending reason in memory
for ``show`` and ``list`` (everything it is computed from is in the database, so a restarted
agent's first pass gives the same reasons).

Fair share (issue 27, ``fairshare.py``): each user's pending jobs are read in id order, and the
users' queues merged by their fair-share factor (ties by id), so that one user's thousand
pending jobs come after another user's one when she used more lately. A user who holds
``agent --max-running-per-user`` jobs already has no more of hers examined (her others wait,
``QOSMaxJobsPerUserLimit``), so her queue takes no room in the window from anyone else's.
"""

from __future__ import annotations

import heapq
import logging
import os
import sqlite3
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tether.agent import depends, fairshare, lifecycle_effects, schedule
from tether.agent.job import Job, Queued
from tether.shared import stamps
from tether.shared.timers import Timer

if TYPE_CHECKING:
    from tether.agent.view import SchedulerAgent as Agent

log = logging.getLogger("tether.agent")

#: pending jobs a pass plans for that could start (Slurm's bf_max_job_test), and the most it
#: reads to find them (held and waiting jobs are read but do not count)
SCHED_WINDOW = 100
SCHED_SCAN = 5000


@dataclass
class RunInfo:
    """What the scheduler knows of a job holding resources: its limit, start and array."""

    limit: float | None = None
    #: epoch seconds: the supervisor's start of the tasks once known, else when it was started
    start: float | None = None
    group: int | None = None
    #: its user and the CPUs it holds (usage, fair share: fairshare.py)
    uid: int | None = None
    cpus: int = 0

    def end(self, now: float) -> float | None:
        if self.limit is None:
            return None
        return (now if self.start is None else self.start) + self.limit


class Scheduler:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        #: the last pass's word on each pending job it examined
        self.reasons: dict[int, str] = {}
        #: the last pass left pending jobs unexamined (their reasons are guessed: ``public``)
        self.partial = False
        #: each user's recent usage, and the fair-share factors of the last pass
        self.usage = fairshare.Usage(agent.cfg.limits.half_life)
        self.usage_read = False
        self.factors: dict[int | None, float] = {}
        #: the users at their running limit after the last pass
        self.full: set[int] = set()
        #: limit, start and array of every job holding resources
        self.run_info: dict[int, RunInfo] = {}
        #: the pass armed for the earliest --begin among the pending jobs
        self.wake: tuple[float, Timer] | None = None

    def run(self) -> None:
        """One pass: start what may start now, cancel what never can, note why the rest
        waits."""
        agent = self.agent
        now = time.time()
        jobs, more, owners = self.queue(now)
        if not jobs:  # nothing waits: nothing to plan (most passes of a busy node's ends)
            self.reasons = {}
            self.partial = more
            self.note_full()
            return
        first_begin: float | None = None
        deps = depends.Facts(agent.db, jobs)  # what the dependencies name (depends.py)
        pending: list[schedule.Pending] = []
        doomed: list[Queued] = []
        for job in jobs:
            blocked = None
            if job.dependency:
                dep = deps.state(job)
                if dep == schedule.NEVER:
                    doomed.append(job)
                    continue
                blocked = schedule.DEPENDENCY if dep == schedule.WAITING else None
            if blocked is None and job.begin_at is not None and job.begin_at > now:
                blocked = schedule.BEGIN_TIME
                first_begin = min(first_begin or job.begin_at, job.begin_at)
            if job.held:
                blocked = schedule.HELD
            pending.append(schedule.Pending(
                job.id, schedule.Res(job.cpus, job.gpus, job.memory_mb),
                job.time_limit, blocked, job.array_id, job.array_max,
                self.limited(owners[job.id])))
        if first_begin is not None:
            self.wake_at(first_begin, now)
        free = schedule.Res(len(agent.ledger.free_cpus), len(agent.ledger.free_gpus),
                            agent.ledger.free_memory)
        # the running jobs are read only if the plan needs them (schedule.plan)
        plan = schedule.plan(pending, self.running_jobs(now), free, now,
                             grace=agent.cfg.cancel_grace, by_user=self.running_by_user(),
                             max_running=agent.cfg.limits.max_running)
        self.reasons = plan.reasons
        self.partial = more
        for n, job_id in enumerate(plan.start):
            if not agent.start(agent.db.get_required(job_id)):  # the plan and the ledger differ
                log.error("job %d: planned to start but does not fit; the next pass decides",
                          job_id)
                self.reasons.update(dict.fromkeys(plan.start[n:], schedule.RESOURCES))
                break
        for queued in doomed:
            # Slurm's kill_invalid_depend: a dependency that can never be satisfied cancels
            agent.job_ended(agent.finalize(queued.id, lifecycle_effects.Finalize(
                state="cancelled", reason=schedule.NEVER)))
            agent.schedule_due = True  # its own dependents, next pass
        self.note_full()

    def note_full(self) -> None:
        """Which users are at their running limit now (``public`` says so of their jobs the
        pass did not examine)."""
        limit = self.agent.cfg.limits.max_running
        self.full = {u for u, n in self.running_by_user().items() if limit and n >= limit}

    def running_jobs(self, now: float) -> Iterator[schedule.Running]:
        """Every job holding resources, as the plan sees it."""
        agent = self.agent
        # time suspended is not run time (the supervisor moves the limit on by it): a job
        # suspended now has no end to plan by, one suspended before ends that much later
        suspended: dict[int, tuple[float | None, float]] | None = None  # read once, if needed
        for job_id, a in agent.allocations.items():
            info = self.run_info.get(job_id, RunInfo())
            end = info.end(now)
            if end is not None:  # only a job with a time limit has an end
                if suspended is None:
                    suspended = agent.db.suspensions()
                since, seconds = suspended.get(job_id, (None, 0.0))
                end = None if since is not None else end + seconds
            yield schedule.Running(
                job_id, schedule.Res(len(a.cpus), len(a.gpus), a.memory_mb), end, info.group)

    def wake_at(self, when: float, now: float) -> None:
        """Have a pass run at ``when`` (epoch seconds: a job's --begin), unless one is due
        sooner already."""
        if self.wake is not None and not self.wake[1].cancelled and self.wake[0] <= when:
            return
        if self.wake is not None:
            self.wake[1].cancel()

        def due() -> None:
            self.wake = None
            self.agent.schedule_due = True
        self.wake = (when, self.agent.timers.at(time.monotonic() + max(0.0, when - now), due))

    def limited(self, uid: int | None) -> int | None:
        """``uid`` if the per-user limits hold for her: not root's or the agent's user's own
        jobs (nor those recorded before users existed, which are the agent's user's)."""
        return None if uid is None or uid in (0, os.getuid()) else uid

    def running_by_user(self) -> Counter[int]:
        """Each limited user's jobs holding resources."""
        out: Counter[int] = Counter()
        for info in self.run_info.values():
            uid = self.limited(info.uid)
            if uid is not None:
                out[uid] += 1
        return out

    def fair(self, now: float, users: list[int | None]) -> dict[int | None, float]:
        """The fair-share factor of each user with usage or pending jobs, as of ``now``: the
        usage of ended jobs (decayed), and of the jobs holding resources so far."""
        self.usage.half_life = self.agent.cfg.limits.half_life  # a reload may change it
        if not self.usage_read:
            self.usage_read = True
            self.read_usage(now)
        usage = self.usage.now(now)
        for info in self.run_info.values():
            if info.start is not None and info.cpus:
                usage[info.uid] = usage.get(info.uid, 0.0) + info.cpus * max(
                    0.0, now - info.start)
        return fairshare.factors(usage, users)

    def read_usage(self, now: float) -> None:
        """The usage of the jobs that ended within ten half-lives, from the accounting
        history (acct.py; the jobs table where there is none), once, at the first pass."""
        since = now - 10 * self.usage.half_life
        db = self.agent.db
        try:
            rows = db.conn.execute("SELECT uid, cpus, started, ended FROM job_acct WHERE "
                                   "ended >= ? AND started IS NOT NULL", (since,)).fetchall()
        except sqlite3.OperationalError:  # no accounting history
            rows = [(uid, cpus, stamps.epoch(s), stamps.epoch(e)) for uid, cpus, s, e in
                    db.conn.execute("SELECT uid, cpus_per_task * ntasks, started_at, ended_at "
                                    "FROM jobs WHERE ended_at IS NOT NULL AND started_at IS "
                                    "NOT NULL")]
        for uid, cpus, start, end in rows:
            if start is not None and end is not None and end >= since:
                self.usage.add(uid, cpus * max(0.0, end - start), end)

    def queue(self, now: float) -> tuple[list[Queued], bool, dict[int, int | None]]:
        """The pending jobs a pass examines, in queue order: each user's in id order, the
        users' merged by fair-share factor (ties by id), until SCHED_WINDOW of them could
        start now (held and waiting ones are passed over and do not count; a user's beyond
        what her running limit leaves room for are not read); whether more pending jobs
        follow; and each examined job's user."""
        db = self.agent.db
        users = db.pending_users()
        self.factors = factors = self.fair(now, [u for u, _, _ in users])
        limit = self.agent.cfg.limits.max_running
        running = self.running_by_user()
        pages: dict[int | None, deque[Queued]] = {}
        room: dict[int | None, int | None] = {}
        heap: list[tuple[float, int, int, int | None]] = []
        more = False
        for n, (uid, _count, first) in enumerate(users):
            mine = self.limited(uid)
            left = None if not limit or mine is None else limit - running[mine]
            room[uid] = left
            if left is not None and left <= 0:
                more = True  # none of hers may start: not read (``public`` says why)
                continue
            pages[uid] = deque()
            heap.append((-factors.get(uid, 1.0), first, n, uid))
        heapq.heapify(heap)
        out: list[Queued] = []
        owners: dict[int, int | None] = {}
        eligible = 0
        while heap:
            if eligible >= SCHED_WINDOW or len(out) >= SCHED_SCAN:
                return out, True, owners
            key, after, n, uid = heapq.heappop(heap)
            page = pages[uid]
            if not page:  # her first page, or the next (``after`` is the next id to read)
                page.extend(db.queue(after - 1, SCHED_WINDOW, uid))
                if not page:
                    continue
            job = page.popleft()
            out.append(job)
            owners[job.id] = uid
            ready = not (job.held or job.dependency
                         or job.begin_at is not None and job.begin_at > now)
            eligible += ready
            left = room[uid]
            if ready and left is not None:
                room[uid] = left = left - 1
                if left <= 0:  # as many as may start: the rest of hers waits unread
                    more = more or bool(page) or bool(db.queue(job.id, 1, uid))
                    continue
            heapq.heappush(heap, (key, page[0].id if page else job.id + 1, n, uid))
        return out, more, owners

    def public(self, job: Job) -> dict[str, Any]:
        """The job object, with a pending job's reason as the last pass saw it, and its
        priority (its user's fair-share factor: fairshare.py)."""
        if job.state == "pending":
            if job.held:
                job.pending_reason = schedule.HELD
            elif job.id in self.reasons:
                job.pending_reason = self.reasons[job.id]
            elif self.partial:
                job.pending_reason = schedule.DEPENDENCY if job.dependency else \
                    schedule.BEGIN_TIME if (job.begin_at or 0) > time.time() else \
                    schedule.USER_LIMIT if job.uid in self.full else schedule.PRIORITY
        out = job.public()
        if job.state == "pending":
            factor = self.factors.get(job.uid)
            if factor is None:  # a user the last pass did not know: as she would be now
                factor = self.fair(time.time(), [*self.factors, job.uid]).get(job.uid, 1.0)
            out["priority"] = fairshare.priority(factor)
        else:
            out["priority"] = None
        return out

    def started(self, job: Job) -> None:
        """The job was just given its resources: its limit counts from about now."""
        self.run_info[job.id] = RunInfo(job.time_limit, time.time(), job.array_id, job.uid,
                                        job.cpus_per_task * job.ntasks)

    def running(self, job: Job) -> None:
        """The supervisor's own start of the tasks, found at reattach: where its time limit
        counts from."""
        self.run_info[job.id] = RunInfo(job.time_limit, stamps.epoch(job.started_at),
                                        job.array_id, job.uid, job.cpus_per_task * job.ntasks)

    def launched(self, job_id: int, started_at: str) -> None:
        """The supervisor's own start of the tasks, just recorded (``started`` told the rest)."""
        info = self.run_info.get(job_id)
        if info is None:  # not started by this agent, nor found at its start: cannot be
            self.running(self.agent.db.get_required(job_id))
        else:
            info.start = stamps.epoch(started_at)

    def released(self, job_id: int) -> None:
        """The job gave its resources back: what it held so far is its user's usage."""
        info = self.run_info.pop(job_id, None)
        if info is not None and info.start is not None and info.cpus:
            now = time.time()
            self.usage.add(info.uid, info.cpus * max(0.0, now - info.start), now)


