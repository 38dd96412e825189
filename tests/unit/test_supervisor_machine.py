"""The supervisor's step machine (supervisor/machine.py): the supervisor-side crash windows of
docs/architecture.md (section 3) as rows of a table, and its invariants on random event sequences.
Pure: no process, socket or file is involved.

A small world stands in for effects.py: it carries out the effects that learn something (the
``launching`` manifest, the exit record) and feeds back what they learned, and it keeps what
would be on disk. A row runs its events, then "kills" the supervisor after every single effect
in turn and asks what the agent would conclude from what is on disk then (lifecycle.md's
probing: the sentinel's result, else ``lost`` if a ``launching`` manifest says tasks may run,
else ``never ran``). The one right outcome of each window must hold at every such point.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from tether.supervisor import machine as mc
from tether.supervisor import machine_effects as fx
from tether.supervisor import machine_events as ev
from tether.supervisor.machine import State
from tether.supervisor.step import NEXT, Phase

PEER, RID = object(), b"1"


@dataclass
class World:
    """What effects.py would have done, and what is on disk."""

    manifest_fails: bool = False
    record_fails: bool = False
    manifest: str | None = None  # None, "launching"
    sentinel: bool = False
    forked: bool = False
    removed: bool = False  # the run directory goes at exit
    told: bool = False  # someone was told the step ended (the agent's wait answered)
    exited: bool = False
    trace: list[tuple[str, bool, bool, bool]] = field(default_factory=list)

    def snapshot(self) -> None:
        self.trace.append((self.manifest or "", self.sentinel, self.forked, self.told))


def feed(m: mc.Machine, event: ev.StepEvent, w: World) -> mc.Machine:
    m, effects = mc.step(m, event)
    for e in effects:
        # after Exit, only closing what came in late (the files of a launch given up)
        assert not w.exited or isinstance(e, fx.DiscardFiles | fx.AnswerClaims), f"{e} after Exit"
        if isinstance(e, fx.RecordLaunching):
            if w.manifest_fails:
                m = feed(m, ev.LaunchNotRecorded(reason="disk full"), w)
            else:
                w.manifest = "launching"
                m = feed(m, ev.LaunchRecorded(time_limit=60.0), w)
            continue
        if isinstance(e, fx.Fork):
            assert w.manifest == "launching", "forked before the launching manifest was durable"
            w.forked = True
        elif isinstance(e, fx.WriteRecord) and e.keep:
            if not w.record_fails:
                w.sentinel = True
            m = feed(m, ev.RecordWritten(ok=not w.record_fails), w)
            continue
        elif isinstance(e, fx.ReleaseWaiters | fx.Announce):
            w.told = True
        elif isinstance(e, fx.RemoveRunDir):
            w.removed = True
        elif isinstance(e, fx.Exit):
            w.exited = True
        w.snapshot()
    return m


def run(events: list[ev.StepEvent], w: World | None = None) -> tuple[mc.Machine, World]:
    w = w or World()
    m = mc.start()
    for e in events:
        m = feed(m, e, w)
    return m, w


def verdict(manifest: str, sentinel: bool) -> str:
    """What a restarted agent concludes from a dead supervisor's run directory."""
    if sentinel:
        return "result"
    return "lost" if manifest == "launching" else "never ran"


CLAIM = ev.ClaimRequested(peer=PEER, rid=RID)
LAUNCH = [CLAIM, ev.FilesOpened()]
END = [ev.AllReaped(), ev.Drained(linger=300.0)]


@dataclass(frozen=True)
class Row:
    name: str
    events: list[ev.StepEvent]
    #: the agent's conclusion should the supervisor die at any point of the row
    crash: set[str]
    state: State
    world: dict[str, bool] = field(default_factory=dict)
    #: what is on disk and done at the row's end
    after: dict[str, bool] = field(default_factory=dict)


ROWS = [
    Row("supervisor dies before L6: ready, unclaimed", [], {"never ran"}, State.READY),
    Row("supervisor dies before L6: claimed, files opening", [CLAIM], {"never ran"},
        State.CLAIMED, after={"forked": False}),
    Row("supervisor dies after L6: tasks running", LAUNCH, {"never ran", "lost"}, State.RUNNING,
        after={"forked": True}),
    Row("the launch cannot be recorded: nothing starts, the claim fails, ready again", LAUNCH,
        {"never ran"}, State.READY, world={"manifest_fails": True}, after={"forked": False}),
    Row("agent never returns in time: the claim deadline leaves a never-started sentinel",
        [ev.ClaimExpired(timeout=30.0)], {"never ran", "result"}, State.GONE,
        after={"sentinel": True, "removed": False, "exited": True}),
    Row("agent aborts before the launch: nothing ran, the run directory goes",
        [ev.AbortRequested(reason="aborted by the agent", cancel=True)], {"never ran"},
        State.GONE, after={"removed": True, "exited": True, "forked": False}),
    Row("agent aborts while the files open, then they arrive: nothing starts",
        [CLAIM, ev.AbortRequested(reason="aborted by the agent", cancel=True), ev.FilesOpened()],
        {"never ran"}, State.GONE, after={"forked": False, "removed": True}),
    Row("agent terminates a ready step: aborted, nothing ran",
        [ev.TerminateRequested(grace=10, cancel=True, why="cancelled")], {"never ran"},
        State.GONE, after={"removed": True, "forked": False}),
    Row("supervisor dies after C1, before C4: the sentinel's result", [*LAUNCH, *END],
        {"lost", "result", "never ran"}, State.ENDED,
        after={"sentinel": True, "told": True, "exited": False}),
    Row("agent after C2, before C3: the supervisor still waits; the ack ends it",
        [*LAUNCH, *END, ev.Acked(reading=False)], {"lost", "result", "never ran"}, State.GONE,
        after={"removed": True, "exited": True}),
    Row("agent slower than the linger: the sentinel alone tells the result",
        [*LAUNCH, *END, ev.LingerExpired(linger=300.0)], {"lost", "result", "never ran"},
        State.GONE, after={"sentinel": True, "removed": False, "exited": True}),
    Row("the disk refuses the record: the linger does not exit with it only in memory",
        [*LAUNCH, *END, ev.LingerExpired(linger=300.0)], {"lost", "never ran"}, State.ENDED,
        world={"record_fails": True}, after={"sentinel": False, "exited": False, "told": True}),
    Row("a terminated step ends with its record like any other",
        [*LAUNCH, ev.TerminateRequested(grace=10, cancel=True, why="cancelled"),
         ev.KillTimer(), *END], {"lost", "result", "never ran"}, State.ENDED,
        after={"sentinel": True}),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_crash_window(row: Row) -> None:
    w = World(**row.world)
    m, w = run(row.events, w)
    assert m.state is row.state, m
    for name, want in row.after.items():
        assert getattr(w, name) is want, (name, w)
    # die after every effect: what the agent then finds is one of the row's outcomes, and
    # "never ran" only where nothing was forked (a requeue would run it twice)
    seen = {verdict("", False)} if not w.trace else set()
    for manifest, sentinel, forked, told in w.trace:
        got = verdict(manifest, sentinel)
        seen.add(got)
        assert not (forked and got == "never ran"), "forked tasks, yet the run dir says never ran"
        # a step that ran: nobody hears of its end before its record is on disk (unless the
        # disk refuses it: then it is served from memory and the process stays)
        assert not (told and forked and not sentinel and not w.record_fails), "told too soon"
    assert seen <= row.crash, seen


# ---- the step's outcome flags ------------------------------------------------------------------

def test_a_cancel_is_the_story_and_the_first_reason_to_stop_stands() -> None:
    m, _ = run([*LAUNCH, ev.TerminateRequested(grace=5, cancel=False, why="terminated by x"),
                ev.TerminateRequested(grace=5, cancel=True, why="cancelled")])
    assert m.state is State.TERMINATING and m.cancelled and m.terminated_by == "terminated by x"
    m2, effects = mc.step(m, ev.TerminateRequested(grace=1, cancel=False, why="again"))
    assert [type(e) for e in effects] == [fx.Terminate], "one kill timer: the first grace stands"


def test_the_time_limit_waits_for_time_suspended_and_not_for_a_cancelled_step() -> None:
    m, _ = run(LAUNCH)
    nxt, effects = mc.step(m, ev.TimeLimit(owed=12.0, grace=10, why="limit"))
    assert nxt == m and effects == [fx.ArmTimer(name="limit", delay=12.0)]
    nxt, effects = mc.step(m, ev.TimeLimit(owed=0.0, grace=10, why="time limit reached"))
    assert nxt.timed_out and nxt.state is State.TERMINATING
    assert effects == [fx.Terminate(why="time limit reached", grace=10),
                       fx.ArmTimer(name="kill", delay=10)]
    cancelled, _ = mc.step(m, ev.TerminateRequested(grace=5, cancel=True, why="cancelled"))
    assert mc.step(cancelled, ev.TimeLimit(owed=0.0, grace=10, why="limit")) == (cancelled, [])


def test_a_fence_fails_the_step_at_once_and_its_reason_is_the_story() -> None:
    m, _ = run([*LAUNCH, ev.TerminateRequested(grace=5, cancel=False, why="terminated")])
    nxt, effects = mc.step(m, ev.Fenced(why="fenced: lease"))
    assert nxt.terminated_by is None
    assert effects == [fx.FailStep(why="fenced: lease"), fx.KillTasks(why="fenced")]


def test_followers_still_reading_keep_an_acknowledged_supervisor_up() -> None:
    m, _ = run([*LAUNCH, *END])
    m, effects = mc.step(m, ev.Acked(reading=True))
    assert m.state is State.ACKED and fx.RemoveRunDir() in effects
    assert fx.Exit not in [type(e) for e in effects]
    assert mc.step(m, ev.AckLingerCheck(reading=True, late=False))[0].state is State.ACKED
    assert mc.step(m, ev.AckLingerCheck(reading=True, late=True))[0].state is State.GONE
    assert mc.step(m, ev.AckLingerCheck(reading=False, late=False))[0].state is State.GONE


def test_resume_after_an_upgrade_keeps_the_step_where_it_was() -> None:
    m = mc.resume(Phase.RUNNING, cancelled=True, timed_out=False, terminated_by=None,
                  durable=False, terminating=True)
    assert m.state is State.TERMINATING and m.cancelled
    assert mc.resume(Phase.READY, cancelled=False, timed_out=False, terminated_by=None,
                     durable=False, terminating=False).state is State.READY


# ---- invariants on random event sequences ----------------------------------------------------

def random_event(rng: random.Random) -> ev.StepEvent:
    return rng.choice([
        lambda: CLAIM,
        lambda: ev.ClaimExpired(timeout=30.0),
        lambda: ev.FilesOpened(),
        lambda: ev.AbortRequested(reason="aborted", cancel=rng.random() < 0.5),
        lambda: ev.TerminateRequested(grace=5, cancel=rng.random() < 0.5, why="stop"),
        lambda: ev.TimeLimit(owed=rng.choice([0.0, 3.0]), grace=5, why="limit"),
        lambda: ev.KillTimer(),
        lambda: ev.Fenced(why="fenced"),
        lambda: ev.AllReaped(),
        lambda: ev.Drained(linger=300.0),
        lambda: ev.LingerExpired(linger=300.0),
        lambda: ev.Acked(reading=rng.random() < 0.5),
        lambda: ev.AckLingerCheck(reading=rng.random() < 0.5, late=rng.random() < 0.5),
    ])()


@pytest.mark.parametrize("seed", range(40))
def test_invariants_hold_on_random_event_sequences(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        w = World(manifest_fails=rng.random() < 0.1, record_fails=rng.random() < 0.2)
        m = mc.start()
        exits = 0
        for _ in range(rng.randint(1, 14)):
            before = m
            trace = len(w.trace)
            was_exited = w.exited
            m = feed(m, random_event(rng), w)
            # the phase moves only as step.py allows, and nothing leaves "gone"
            assert m.phase is before.phase or m.phase in NEXT[before.phase], (before, m)
            if before.final:
                assert m.state is State.GONE
            exits += int(w.exited and not was_exited)
            for manifest, sentinel, forked, _told in w.trace[trace:]:
                assert not (forked and verdict(manifest, sentinel) == "never ran")
        assert exits <= 1
        # a step that ran is left only once the agent has its result or the disk does
        if w.exited and w.forked and not w.removed:
            assert w.sentinel, "exited with the result only in memory"


def test_every_effect_and_event_has_a_place() -> None:
    """Every step event appears in the table, and effects.py knows every effect."""
    from tether.supervisor import effects as io

    used = {t for (_s, t) in mc.TABLE}
    assert used == set(ev.StepEvent.__args__)  # type: ignore[attr-defined]
    assert set(io._EFFECTS) == set(fx.Effect.__args__)  # type: ignore[attr-defined]


def test_every_method_the_parts_declare_for_each_other_exists() -> None:
    """state.py declares them for the type checker only: each must be some part's."""
    import inspect
    import re

    from tether.supervisor import state
    from tether.supervisor.service import Supervisor

    names = re.findall(r"\n        def ([a-z_]+)\(", inspect.getsource(state))
    assert len(names) > 30
    assert [n for n in names if not callable(getattr(Supervisor, n, None))] == []
