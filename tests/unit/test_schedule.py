"""The scheduler's pure parts: EASY backfill (``agent/schedule.py``), dependencies, and the
Slurm notations of ``shared/jobopts.py``, each as a table of scenarios."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tether.agent.schedule import (
    ARRAY_LIMIT,
    DEPENDENCY,
    HELD,
    NEVER,
    PRIORITY,
    RESOURCES,
    SATISFIED,
    WAITING,
    Pending,
    Res,
    Running,
    dependency_state,
    plan,
)
from tether.shared import jobopts

NOW = 1000.0


def P(id: int, cpus: int = 1, limit: float | None = None, *, gpus: int = 0, mem: int = 0,
      blocked: str | None = None, group: int | None = None, gmax: int | None = None) -> Pending:
    return Pending(id, Res(cpus, gpus, mem), limit, blocked, group, gmax)


def R(id: int, cpus: int = 1, end: float | None = None, *, gpus: int = 0, mem: int = 0,
      group: int | None = None) -> Running:
    return Running(id, Res(cpus, gpus, mem), end, group)


@dataclass
class Case:
    name: str
    pending: list[Pending]
    running: list[Running]
    free: Res
    start: list[int]
    reasons: dict[int, str] = field(default_factory=dict)
    shadow: float | None = None
    grace: float = 0.0


CASES = [
    Case("an empty queue starts nothing", [], [R(1, 4, None)], Res(0), []),
    Case("FIFO while everything fits", [P(2), P(3), P(4)], [], Res(4), [2, 3, 4]),
    Case("strict FIFO without time limits: small jobs wait behind a big one",
         [P(2, 4), P(3), P(4)], [R(1, 2)], Res(2), [],
         {2: RESOURCES, 3: PRIORITY, 4: PRIORITY}),
    Case("issue 13's friction 5: two 1-CPU jobs with limits backfill beside a 4-CPU job",
         [P(2, 4), P(3, 1, 60), P(4, 1, 60)], [R(1, 2, NOW + 100)], Res(2), [3, 4],
         {2: RESOURCES}, shadow=NOW + 100),
    Case("a job that would end after the shadow time waits",
         [P(2, 4), P(3, 1, 200)], [R(1, 2, NOW + 100)], Res(2), [], {2: RESOURCES, 3: PRIORITY},
         shadow=NOW + 100),
    Case("ending exactly at the shadow time is not a delay (a tie)",
         [P(2, 4), P(3, 1, 100)], [R(1, 2, NOW + 100)], Res(2), [3], {2: RESOURCES},
         shadow=NOW + 100),
    Case("the kill grace counts on both sides: 100 + 5 still ends by 100 + 5",
         [P(2, 4), P(3, 1, 100)], [R(1, 2, NOW + 100)], Res(2), [3], {2: RESOURCES},
         shadow=NOW + 105, grace=5.0),
    Case("a job without a limit may use what the blocked job will not need (the extra)",
         [P(2, 3), P(3, 1)], [R(1, 2, NOW + 50)], Res(2), [3], {2: RESOURCES},
         shadow=NOW + 50),
    Case("the extra is used up: the second long job waits",
         [P(2, 3), P(3, 1), P(4, 1)], [R(1, 2, NOW + 50)], Res(2), [3],
         {2: RESOURCES, 4: PRIORITY}, shadow=NOW + 50),
    Case("a short job does not use up the extra; a long one after it still fits there",
         [P(2, 3), P(3, 1, 10), P(4, 1)], [R(1, 3, NOW + 50)], Res(1), [3],
         {2: RESOURCES, 4: PRIORITY}, shadow=NOW + 50),
    Case("what the blocked job needs is held by a job without a limit: FIFO behind it",
         [P(2, 4), P(3, 1, 1)], [R(1, 2, None)], Res(2), [], {2: RESOURCES, 3: PRIORITY}),
    Case("jobs without limits never end, but ones with limits free enough: a shadow",
         [P(2, 3), P(3, 1, 5)], [R(1, 1, None), R(5, 2, NOW + 30)], Res(1), [3],
         {2: RESOURCES}, shadow=NOW + 30),
    Case("the earliest end that frees enough sets the shadow, not the first to end",
         [P(2, 4), P(3, 1, 25)], [R(1, 1, NOW + 10), R(5, 2, NOW + 20)], Res(1), [],
         {2: RESOURCES, 3: PRIORITY}, shadow=NOW + 20),
    Case("several running jobs ending at the same moment all count (equal-start tie)",
         [P(2, 4), P(3, 1, 100)], [R(1, 1, NOW + 100), R(5, 2, NOW + 100)], Res(1), [3],
         {2: RESOURCES}, shadow=NOW + 100),
    Case("GPUs: a CPU job may not take the GPU the blocked job waits for... it needs none",
         [P(2, 1, gpus=2), P(3, 1)], [R(1, 1, NOW + 60, gpus=1)], Res(3, 1), [3],
         {2: RESOURCES}, shadow=NOW + 60),
    Case("GPUs: a long GPU job would take what the blocked job needs",
         [P(2, 1, gpus=2), P(3, 1, gpus=1)], [R(1, 1, NOW + 60, gpus=1)], Res(3, 1), [],
         {2: RESOURCES, 3: PRIORITY}, shadow=NOW + 60),
    Case("GPUs: a short GPU job fits in the gap",
         [P(2, 1, gpus=2), P(3, 1, 30, gpus=1)], [R(1, 1, NOW + 60, gpus=1)], Res(3, 1), [3],
         {2: RESOURCES}, shadow=NOW + 60),
    Case("memory blocks like CPUs: the big-memory job waits, a long small one fits the extra",
         [P(2, 1, mem=800), P(3, 1, mem=100), P(4, 1, mem=300)],
         [R(1, 1, NOW + 40, mem=600)], Res(3, 0, 400), [3],
         {2: RESOURCES, 4: PRIORITY}, shadow=NOW + 40),
    Case("a job that fits nowhere now waits even if short",
         [P(2, 4), P(3, 3, 1)], [R(1, 2, NOW + 100)], Res(2), [], {2: RESOURCES, 3: PRIORITY},
         shadow=NOW + 100),
    Case("held and waiting jobs are passed over and block nobody",
         [P(2, 4, blocked=HELD), P(3, 2, blocked=DEPENDENCY), P(4, 2)], [R(1, 2)], Res(2),
         [4], {2: HELD, 3: DEPENDENCY}),
    Case("an array's %MAX: elements beyond it wait (JobArrayTaskLimit), others go on",
         [P(2, group=9, gmax=2), P(3, group=9, gmax=2), P(4, group=9, gmax=2), P(5)],
         [R(1, 1, group=9)], Res(4), [2, 5], {3: ARRAY_LIMIT, 4: ARRAY_LIMIT}),
    Case("only the first blocked job gets a reservation (EASY, not conservative)",
         [P(2, 4), P(3, 3), P(4, 1, 5)], [R(1, 2, NOW + 10)], Res(2), [4],
         {2: RESOURCES, 3: PRIORITY}, shadow=NOW + 10),
    Case("jobs started in this pass count toward the shadow time",
         [P(2, 1, 50), P(3, 5), P(4, 1, 60)], [R(1, 2, NOW + 20)], Res(3), [2],
         {3: RESOURCES, 4: PRIORITY}, shadow=NOW + 50),
    Case("an overdue running job (being killed) is expected to end now, not in the past",
         [P(2, 4), P(3, 1, 1)], [R(1, 2, NOW - 30)], Res(2), [], {2: RESOURCES, 3: PRIORITY},
         shadow=NOW),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan(case: Case) -> None:
    got = plan(case.pending, case.running, case.free, NOW, grace=case.grace)
    assert got.start == case.start
    assert got.reasons == case.reasons
    assert got.shadow == case.shadow


class _Counted:
    """The running jobs as an iterable that counts how often it is read."""

    def __init__(self, running: list[Running]) -> None:
        self.running = running
        self.reads = 0

    def __iter__(self) -> Iterator[Running]:
        self.reads += 1
        return iter(self.running)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan_reads_the_running_jobs_once_and_only_when_a_job_needs_them(case: Case) -> None:
    """A pass whose jobs all fit reads none of a busy node's running jobs (agent/scheduler.py
    builds them one by one as they are read); any other reads them once, with the same plan."""
    counted = _Counted(case.running)
    got = plan(case.pending, counted, case.free, NOW, grace=case.grace)
    assert (got.start, got.reasons, got.shadow) == (case.start, case.reasons, case.shadow)
    needed = got.blocked is not None or any(
        p.blocked is None and p.group is not None and p.group_max is not None
        for p in case.pending)
    assert counted.reads == (1 if needed else 0)


@pytest.mark.parametrize("case", [c for c in CASES if c.shadow is not None],
                         ids=[c.name for c in CASES if c.shadow is not None])
def test_backfill_never_delays_the_blocked_job(case: Case) -> None:
    """Replay the plan: the blocked job still fits at its shadow time with every job the plan
    started still holding what it holds then."""
    got = plan(case.pending, case.running, case.free, NOW, grace=case.grace)
    assert got.blocked is not None and got.shadow is not None
    need = {p.id: p for p in case.pending}
    at_shadow = case.free
    for r in case.running:
        if r.end is not None and max(NOW, r.end + case.grace) <= got.shadow:
            at_shadow = at_shadow + r.holds
    for job in got.start:
        p = need[job]
        if p.limit is not None and NOW + p.limit + case.grace <= got.shadow:
            continue  # gone by then
        at_shadow = at_shadow - p.need
    assert need[got.blocked].need.within(at_shadow)


DEPS = [
    ([], {}, SATISFIED),
    ([("afterok", 1)], {1: "completed"}, SATISFIED),
    ([("afterok", 1)], {1: "running"}, WAITING),
    ([("afterok", 1)], {1: "failed"}, NEVER),
    ([("afterok", 1)], {1: "timeout"}, NEVER),
    ([("afterok", 1)], {1: "cancelled"}, NEVER),
    ([("afterany", 1)], {1: "lost"}, SATISFIED),
    ([("afterany", 1)], {1: "pending"}, WAITING),
    ([("afternotok", 1)], {1: "failed"}, SATISFIED),
    ([("afternotok", 1)], {1: "completed"}, NEVER),
    ([("afternotok", 1)], {1: "starting"}, WAITING),
    ([("afterok", 1), ("afterok", 2)], {1: "completed", 2: "running"}, WAITING),
    ([("afterok", 1), ("afterok", 2)], {1: "running", 2: "failed"}, NEVER),
    ([("afterok", 7)], {}, NEVER),
]


@pytest.mark.parametrize("deps, states, want", DEPS)
def test_dependency_state(deps: list[tuple[str, int]], states: dict[int, str],
                          want: str) -> None:
    assert dependency_state(deps, states) == want


#: an array (id 10) of three elements, by index: (kind, array states) -> verdict (issue 28,
#: point 4: Slurm's semantics, where one failed element used to cancel afterok and afternotok
#: dependents alike)
ARRAY_DEPS = [
    ("afterok", ["completed", "completed", "completed"], SATISFIED),
    ("afterok", ["completed", "running", "pending"], WAITING),
    ("afterok", ["completed", "failed", "running"], NEVER),
    ("afternotok", ["completed", "failed", "running"], WAITING),  # not all ended yet
    ("afternotok", ["completed", "failed", "completed"], SATISFIED),
    ("afternotok", ["timeout", "cancelled", "lost"], SATISFIED),
    ("afternotok", ["completed", "completed", "completed"], NEVER),
    ("afternotok", ["completed", "completed", "running"], WAITING),
    ("afterany", ["completed", "failed", "running"], WAITING),
    ("afterany", ["completed", "failed", "cancelled"], SATISFIED),
    ("after", ["running", "completed", "pending"], WAITING),
    ("after", ["running", "completed", "starting"], SATISFIED),
    ("after", ["cancelled", "running", "failed"], SATISFIED),
]


@pytest.mark.parametrize("kind, states, want", ARRAY_DEPS)
def test_dependency_on_a_whole_array(kind: str, states: list[str], want: str) -> None:
    arrays = {10: dict(enumerate(states))}
    assert dependency_state([(kind, -10)], {}, arrays) == want
    # one element named (ID_INDEX: its own job id) is a job of its own, as before
    assert dependency_state([(kind, 11)], {11: states[1]}) == dependency_state(
        [(kind, -10)], {}, {10: {1: states[1]}})


@pytest.mark.parametrize("index, want", [(0, SATISFIED), (1, NEVER), (2, WAITING),
                                         (7, NEVER), (None, NEVER)])
def test_aftercorr_pairs_elements_by_index(index: int | None, want: str) -> None:
    """Element i waits for element i of the other array; one without a counterpart waits for
    the whole array, as afterok."""
    arrays = {10: {0: "completed", 1: "failed", 2: "running"}}
    assert dependency_state([("aftercorr", -10)], {}, arrays, index) == want


def test_singleton_waits_while_busy_and_unknown_arrays_never_satisfy() -> None:
    assert dependency_state([("singleton", 0)], {}, busy=True) == WAITING
    assert dependency_state([("singleton", 0)], {}, busy=False) == SATISFIED
    assert dependency_state([("singleton", 0), ("afterok", 1)], {1: "running"}) == WAITING
    assert dependency_state([("afterok", -10)], {}, {}) == NEVER
    assert dependency_state([("afterany", -10)], {}, {10: {}}) == NEVER


@pytest.mark.parametrize("text, seconds", [
    ("5", 300), ("0:02", 2), ("1:30", 90), ("2:00:00", 7200), ("1-0", 86400),
    ("1-2", 93600), ("1-2:30", 95400), ("0-0:0:5", 5), ("90", 5400), ("01:02:03", 3723),
])
def test_time_formats(text: str, seconds: int) -> None:
    assert jobopts.parse_time(text) == seconds


@pytest.mark.parametrize("text, why", [
    ("0", "zero"), ("0:00", "zero"), ("", "not a time limit"), ("1:2:3:4", "not a time"),
    ("-5", "not a time"), ("1h", "not a time"), ("400-0", "more than a year"),
    ("1.5", "not a time"),
])
def test_bad_times(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        jobopts.parse_time(text)


def test_format_time() -> None:
    assert [jobopts.format_time(s) for s in (2, 3723, 93600)] == [
        "00:00:02", "01:02:03", "1-02:00:00"]


@pytest.mark.parametrize("text, indices, cap", [
    ("0-3", [0, 1, 2, 3], None), ("0-9:3", [0, 3, 6, 9], None), ("1,3,5-7", [1, 3, 5, 6, 7], None),
    ("0-19%5", list(range(20)), 5), ("7", [7], None), ("2,2,1", [1, 2], None),
])
def test_array_specs(text: str, indices: list[int], cap: int | None) -> None:
    assert jobopts.parse_array(text) == (indices, cap)


@pytest.mark.parametrize("text, why", [
    ("5-1", "ends before"), ("0-9:0", "step"), ("0-3%0", "%MAX"), ("a", "not N"),
    ("0-5000", "more than 1000"), ("", "not N"), ("1-2%x", "%MAX"),
])
def test_bad_array_specs(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        jobopts.parse_array(text)


def test_dependencies() -> None:
    assert jobopts.parse_dependency("afterok:3:4_2,afterany:9") == [
        ("afterok", 3, None), ("afterok", 4, 2), ("afterany", 9, None)]
    for bad, why in (("after:3", "not one of"), ("afterok", "names no job"),
                     ("afterok:x", "not a job id"), ("afterok:1?afterany:2", "not supported"),
                     ("singleton", "not one of")):  # a cluster's kinds: the first three
        with pytest.raises(ValueError, match=why):
            jobopts.parse_dependency(bad)
    # a node's: Slurm's after, aftercorr and singleton too; ID_* is the whole array
    assert jobopts.parse_dependency("after:3,aftercorr:5_*,singleton,afterok:4_2",
                                    jobopts.NODE_KINDS) == [
        ("after", 3, None), ("aftercorr", 5, None), ("singleton", 0, None), ("afterok", 4, 2)]
    for bad, why in (("singleton:3", "names no job"), ("afterok:4_2_*", "not a job id"),
                     ("before:3", "not one of")):
        with pytest.raises(ValueError, match=why):
            jobopts.parse_dependency(bad, jobopts.NODE_KINDS)


@pytest.mark.parametrize("indices, step", [([0, 1, 2], 1), ([1, 3, 5, 7], 2), ([4], 1),
                                           ([1, 2, 4], 1), ([0, 10], 10)])
def test_array_facts(indices: list[int], step: int) -> None:
    facts = jobopts.array_facts(indices)
    assert facts == {"TETHER_ARRAY_TASK_COUNT": str(len(indices)),
                     "TETHER_ARRAY_TASK_MIN": str(indices[0]),
                     "TETHER_ARRAY_TASK_MAX": str(indices[-1]),
                     "TETHER_ARRAY_TASK_STEP": str(step)}


def test_begin_times() -> None:
    from datetime import datetime

    now = datetime(2026, 12, 1, 10, 30, 0).timestamp()  # local time
    at = jobopts.parse_begin
    assert [at(t, now) - now for t in ("now", "now+2", "now+5m", "now+1hour", "now+2days")] == [
        0, 2, 300, 3600, 172800]
    assert at("11:00", now) == datetime(2026, 12, 1, 11, 0).timestamp()
    assert at("10:30", now) == datetime(2026, 12, 2, 10, 30).timestamp()  # passed: tomorrow
    assert at("09:15:30", now) == datetime(2026, 12, 2, 9, 15, 30).timestamp()
    assert at("2026-12-24", now) == datetime(2026, 12, 24).timestamp()
    assert at("2026-11-01T08:00", now) < now  # in the past: eligible at once
    for bad, why in (("tomorrow", "not a begin time"), ("now+5y", "unknown unit"),
                     ("25:00", "not a time of day"), ("2026-13-01", "not a date"),
                     ("now+400d", "more than a year")):
        with pytest.raises(ValueError, match=why):
            at(bad, now)
