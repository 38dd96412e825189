"""The agent's scheduler pass: the I/O half of ``schedule.py`` (issue 13).

Each pass reads the queue from the database (``Store.queue``: a window of jobs that could
start, in id order, with only the columns planning needs), the predecessors' states, and the
ledger's free counts; hands them with the running jobs' expected ends to the pure
``schedule.plan``; starts what the plan starts (``Agent.start``), cancels the jobs whose
dependency can never be satisfied, and keeps each other examined job's pending reason in memory
for ``show`` and ``list`` (everything it is computed from is in the database, so a restarted
agent's first pass gives the same reasons).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tether.agent import lifecycle_effects, schedule
from tether.agent.job import Job, Queued
from tether.shared import stamps
from tether.shared.timers import Timer

if TYPE_CHECKING:
    from tether.agent.daemon import Agent

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

    def end(self, now: float) -> float | None:
        if self.limit is None:
            return None
        return (now if self.start is None else self.start) + self.limit


class Scheduler:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        #: the last pass's word on each pending job it examined
        self.reasons: dict[int, str] = {}
        #: the last id the last pass examined when more pending jobs followed, else None
        self.queue_end: int | None = None
        #: limit, start and array of every job holding resources
        self.run_info: dict[int, RunInfo] = {}
        #: the pass armed for the earliest --begin among the pending jobs
        self.wake: tuple[float, Timer] | None = None

    def run(self) -> None:
        """One pass: start what may start now, cancel what never can, note why the rest
        waits."""
        agent = self.agent
        now = time.time()
        jobs, more = self.queue(now)
        if not jobs:  # nothing waits: nothing to plan (most passes of a busy node's ends)
            self.reasons = {}
            self.queue_end = None
            return
        first_begin: float | None = None
        states = agent.db.states_of({j for job in jobs for _, j in job.dependency})
        pending: list[schedule.Pending] = []
        doomed: list[Queued] = []
        for job in jobs:
            blocked = None
            if job.dependency:
                dep = schedule.dependency_state(job.dependency, states)
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
                job.time_limit, blocked, job.array_id, job.array_max))
        if first_begin is not None:
            self.wake_at(first_begin, now)
        free = schedule.Res(len(agent.ledger.free_cpus), len(agent.ledger.free_gpus),
                            agent.ledger.free_memory)
        # the running jobs are read only if the plan needs them (schedule.plan)
        plan = schedule.plan(pending, self.running_jobs(now), free, now,
                             grace=agent.cfg.cancel_grace)
        self.reasons = plan.reasons
        self.queue_end = jobs[-1].id if more else None
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

    def queue(self, now: float) -> tuple[list[Queued], bool]:
        """The pending jobs a pass examines: in queue order, until SCHED_WINDOW of them could
        start now (held and waiting ones are passed over and do not count); and whether more
        pending jobs follow."""
        out: list[Queued] = []
        eligible = 0
        while True:
            page = self.agent.db.queue(out[-1].id if out else 0, SCHED_WINDOW)
            for job in page:
                if eligible >= SCHED_WINDOW or len(out) >= SCHED_SCAN:
                    return out, True
                out.append(job)
                eligible += not (job.held or job.dependency
                                 or job.begin_at is not None and job.begin_at > now)
            if len(page) < SCHED_WINDOW:
                return out, False

    def public(self, job: Job) -> dict[str, Any]:
        """The job object, with a pending job's reason as the last pass saw it."""
        if job.state == "pending":
            if job.held:
                job.pending_reason = schedule.HELD
            elif job.id in self.reasons:
                job.pending_reason = self.reasons[job.id]
            elif self.queue_end is not None and job.id > self.queue_end:
                job.pending_reason = schedule.DEPENDENCY if job.dependency else \
                    schedule.BEGIN_TIME if (job.begin_at or 0) > time.time() else \
                    schedule.PRIORITY
        return job.public()

    def started(self, job: Job) -> None:
        """The job was just given its resources: its limit counts from about now."""
        self.run_info[job.id] = RunInfo(job.time_limit, time.time(), job.array_id)

    def running(self, job: Job) -> None:
        """The supervisor's own start of the tasks, found at reattach: where its time limit
        counts from."""
        self.run_info[job.id] = RunInfo(job.time_limit, stamps.epoch(job.started_at), job.array_id)

    def launched(self, job_id: int, started_at: str) -> None:
        """The supervisor's own start of the tasks, just recorded (``started`` told the rest)."""
        info = self.run_info.get(job_id)
        if info is None:  # not started by this agent, nor found at its start: cannot be
            self.running(self.agent.db.get_required(job_id))
        else:
            info.start = stamps.epoch(started_at)

    def released(self, job_id: int) -> None:
        self.run_info.pop(job_id, None)


