"""Which pending jobs start now, and why each other one waits: EASY backfill. Pure.

Theory of operation (Slurm's ``sched/backfill`` in its EASY form). Pending jobs are taken in
queue order (by id). While every job so far has started, the next one starts if it fits in the
free resources. The first eligible job that does not fit is *blocked* (reason ``Resources``):
from the running jobs' expected ends (start + time limit + the kill grace: the limit is
enforced by SIGTERM, then SIGKILL after the grace) the earliest moment it will fit is its
*shadow time*, and whatever will still be free then beyond its needs is *extra*. A later job
may then start now (be backfilled) only if it fits in the free resources now and either, by its
own time limit, ends by the shadow time, or fits in the extra (so it takes nothing the blocked
job will need, however long it runs); a job started from the extra reduces it. So the blocked
job's start is never delayed. Every other later job waits with reason ``Priority``.

A running job without a time limit never ends as far as planning goes: if the blocked job needs
what such a job holds there is no shadow time, and nothing behind it starts: strict FIFO, as
without time limits at all.

Jobs that may not start whatever the resources (a dependency, a hold, an array's ``%MAX``) are
passed over with their reason and block nobody. Resources are counts (CPUs, GPUs, MiB): the
ledger hands out any free ids, so counts are all that decide whether a job fits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tether.agent.job import FINAL

# Pending reasons, in Slurm's words (squeue(1), "JOB REASON CODES").
RESOURCES = "Resources"
PRIORITY = "Priority"
DEPENDENCY = "Dependency"
NEVER = "DependencyNeverSatisfied"
HELD = "JobHeldUser"
ARRAY_LIMIT = "JobArrayTaskLimit"
BEGIN_TIME = "BeginTime"
#: its user runs as many jobs as she may (agent --max-running-per-user; Slurm's MaxJobs)
USER_LIMIT = "QOSMaxJobsPerUserLimit"


@dataclass(frozen=True, slots=True)
class Res:
    cpus: int = 0
    gpus: int = 0
    memory_mb: int = 0

    def within(self, other: Res) -> bool:
        return (self.cpus <= other.cpus and self.gpus <= other.gpus
                and self.memory_mb <= other.memory_mb)

    def __add__(self, other: Res) -> Res:
        return Res(self.cpus + other.cpus, self.gpus + other.gpus,
                   self.memory_mb + other.memory_mb)

    def __sub__(self, other: Res) -> Res:
        return Res(self.cpus - other.cpus, self.gpus - other.gpus,
                   self.memory_mb - other.memory_mb)


@dataclass(frozen=True, slots=True)
class Pending:
    id: int
    need: Res
    #: seconds; None: no limit
    limit: float | None = None
    #: why it may not start whatever the resources (a hold, a dependency), or None
    blocked: str | None = None
    #: the array it belongs to and the array's ``%MAX`` (elements running at once)
    group: int | None = None
    group_max: int | None = None
    #: its user, when a limit of running jobs holds for her (``plan``'s ``max_running``)
    user: int | None = None


@dataclass(frozen=True, slots=True)
class Running:
    id: int
    holds: Res
    #: when its time limit runs out (start + limit, seconds on the caller's clock); None: never
    end: float | None = None
    group: int | None = None


@dataclass
class Plan:
    #: the jobs to start now, in order
    start: list[int] = field(default_factory=list)
    #: why each pending job that does not start waits
    reasons: dict[int, str] = field(default_factory=dict)
    #: the first blocked job and when it is expected to start (None: no blocked job, or no
    #: time can be given because what it needs is held by jobs without a limit)
    blocked: int | None = None
    shadow: float | None = None


def _reservation(need: Res, free: Res, ends: list[tuple[float | None, Res]],
                 ) -> tuple[float, Res] | None:
    """The earliest moment ``need`` fits as the running jobs end, and what is left over then."""
    avail = free
    finite = sorted(((e, r) for e, r in ends if e is not None), key=lambda er: er[0])
    i = 0
    while i < len(finite):
        when = finite[i][0]
        while i < len(finite) and finite[i][0] == when:  # every job ending at that moment
            avail = avail + finite[i][1]
            i += 1
        if need.within(avail):
            return when, avail - need
    return None


class _Holding:
    """What the running jobs, and those the plan starts, hold: their expected ends and the
    count per array. ``running`` is read only once a pending job needs either (a blocked job,
    an array with a ``%MAX``): a pass whose jobs all fit reads none of a busy node's jobs."""

    def __init__(self, running: Iterable[Running], now: float, grace: float) -> None:
        self.running: Iterable[Running] | None = running
        self.now = now
        self.grace = grace
        self._ends: list[tuple[float | None, Res]] = []
        self._groups: Counter[int] = Counter()

    def _read(self) -> None:
        if self.running is None:
            return
        started, self._ends = self._ends, []
        for r in self.running:
            self._ends.append((None if r.end is None else max(self.now, r.end + self.grace),
                               r.holds))
            if r.group is not None:
                self._groups[r.group] += 1
        self._ends += started
        self.running = None

    def ends(self) -> list[tuple[float | None, Res]]:
        self._read()
        return self._ends

    def in_group(self, group: int) -> int:
        self._read()
        return self._groups[group]

    def started(self, end: float | None, need: Res, group: int | None) -> None:
        self._ends.append((end, need))
        if group is not None:
            self._groups[group] += 1


def plan(pending: Iterable[Pending], running: Iterable[Running], free: Res, now: float,
         grace: float = 0.0, by_user: Mapping[int, int] | None = None,
         max_running: int = 0) -> Plan:
    """Which of ``pending`` (in queue order) start now, and why the others wait.

    ``free`` is what is free now; ``grace`` is added to every time limit (the kill grace, how
    long a job at its limit may still hold its resources). ``running`` is iterated at most
    once, and only if a pending job's fate depends on it. ``by_user`` counts each user's jobs
    holding resources: a job whose ``user`` is set waits (``USER_LIMIT``, blocking nobody, as
    a hold does) while hers reach ``max_running`` (0: no limit).
    """
    out = Plan()
    holding = _Holding(running, now, grace)
    shadow: tuple[float, Res] | None = None
    users = Counter(by_user or {})
    for p in pending:
        if p.blocked is not None:
            out.reasons[p.id] = p.blocked
            continue
        if max_running and p.user is not None and users[p.user] >= max_running:
            out.reasons[p.id] = USER_LIMIT
            continue
        if p.group is not None and p.group_max is not None and \
                holding.in_group(p.group) >= p.group_max:
            out.reasons[p.id] = ARRAY_LIMIT
            continue
        fits = p.need.within(free)
        end = None if p.limit is None else now + p.limit + grace
        if out.blocked is None:
            if not fits:
                out.blocked = p.id
                out.reasons[p.id] = RESOURCES
                shadow = _reservation(p.need, free, holding.ends())
                out.shadow = None if shadow is None else shadow[0]
                continue
        elif shadow is None or not fits:
            out.reasons[p.id] = PRIORITY
            continue
        elif end is None or end > shadow[0]:
            if not p.need.within(shadow[1]):
                out.reasons[p.id] = PRIORITY
                continue
            shadow = (shadow[0], shadow[1] - p.need)  # it still runs then: out of the extra
        out.start.append(p.id)
        free = free - p.need
        holding.started(end, p.need, p.group)
        if p.user is not None:
            users[p.user] += 1
    return out


# ---- dependencies ----------------------------------------------------------------------------

SATISFIED = "satisfied"
WAITING = "waiting"


def dependency_state(deps: Iterable[tuple[str, int]], states: Mapping[int, str],
                     arrays: Mapping[int, Mapping[int, str]] | None = None,
                     index: int | None = None, busy: bool = False) -> str:
    """``satisfied``, ``waiting`` or ``DependencyNeverSatisfied`` for ``deps`` ((kind, ref)
    pairs, all of which must hold), Slurm's way. A ref is a job id (an array's element named by
    ``ID_INDEX`` too), ``-ID`` for every element of array ID, 0 for ``singleton``.

    ``states``: the named jobs' states; ``arrays``: each named array's element states by index;
    ``index``: the dependent's own array index (``aftercorr``); ``busy``: another job of its user
    and name runs, or waits ahead of it (``singleton``). Over an array, ``afterok`` holds once
    every element completed (never, once one ended otherwise), ``afternotok`` once every element
    ended and one did not complete (never, once all completed), ``afterany`` once all ended,
    ``after`` once all started (or ended); ``aftercorr`` is ``afterok`` on the element of the
    same index (on the whole array where it has none). An unknown job never satisfies
    anything."""
    result = SATISFIED
    for kind, ref in deps:
        if kind == "singleton":
            if busy:
                result = WAITING
            continue
        if ref < 0:
            elements = (arrays or {}).get(-ref) or {}
            if kind == "aftercorr" and index is not None and index in elements:
                group = [elements[index]]
            else:
                group = list(elements.values())
        else:
            state = states.get(ref)
            group = [] if state is None else [state]
        if not group:
            return NEVER
        ended = all(s in FINAL for s in group)
        completed = [s == "completed" for s in group]
        if kind in ("afterok", "aftercorr"):
            ok = all(completed)
            never = any(s in FINAL and s != "completed" for s in group)
        elif kind == "afternotok":
            ok, never = ended and not all(completed), all(completed)
        elif kind == "after":  # started (or ended without starting: Slurm's "or cancelled")
            ok, never = all(s != "pending" for s in group), False
        else:  # afterany
            ok, never = ended, False
        if never:
            return NEVER
        if not ok:
            result = WAITING
    return result
