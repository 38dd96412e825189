"""The agent's lifecycle machine (agent/lifecycle.py): every crash-window row of
docs/architecture.md (section 7) that involves it as one row of a table (the two that involve
no machine name the test with real processes that checks them: ``ELSEWHERE``), and its
invariants on random event sequences. Pure: no process, socket or file is involved."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tether.agent import lifecycle as lc
from tether.agent import lifecycle_effects as fx
from tether.agent import lifecycle_events as evs
from tether.agent.lifecycle import State

RESULT = evs.Result(state="completed", exit_code=0)
FAILED = evs.Result(state="failed", exit_code=3)
NEVER = evs.NeverRan(reason="its supervisor is gone and never launched the tasks")
LOST = evs.Lost(reason="supervisor (pid 9) died while the job was running")


def fresh(cancel: bool = False, attempt: int = 1) -> lc.Machine:
    m, effects = lc.start(7, attempt, cancel=cancel)
    assert effects == [fx.Spawn()]
    return m


def adopted(running: bool, cancel: bool = False, attempt: int = 1) -> lc.Machine:
    return lc.step(lc.adopt(7, attempt, running=running, cancel=cancel), evs.Restored())[0]


def orphaned() -> lc.Machine:
    m, effects = lc.orphan(7, 1)
    assert effects == [fx.Ack()]
    return m


def run(m: lc.Machine, events: list[evs.Event]) -> tuple[lc.Machine, list[fx.Effect]]:
    out: list[fx.Effect] = []
    for ev in events:
        m, effects = lc.step(m, ev)
        _durable_first(effects)
        out += effects
    return m, out


def kinds(effects: list[fx.Effect]) -> list[str]:
    return [type(e).__name__ for e in effects]


def outcome(effects: list[fx.Effect]) -> str | None:
    """``requeue``, a final state, or None if the attempt was not settled."""
    for e in effects:
        if isinstance(e, fx.Requeue):
            return "requeue"
        if isinstance(e, fx.Finalize):
            return e.state
    return None


HELLO = evs.HelloAnswered
CLAIMED = evs.Claimed(pids=(100,), started_at="t")
CONNECTED = [evs.Spawned(pid=50)]
CLAIMING = [*CONNECTED, HELLO(phase="ready")]
WAITING = [*CLAIMING, CLAIMED]


@dataclass(frozen=True)
class Row:
    row: str
    start: Callable[[], lc.Machine]
    events: list[evs.Event]
    outcome: str | None  # what the attempt becomes: requeue, a final state, or None
    state: State | None = None
    must: tuple[str, ...] = ()  # effect kinds that must appear
    never: tuple[str, ...] = ()  # effect kinds that must not appear


ROWS = [
    Row("2", lambda: adopted(False), [evs.NoRunDir(path="/r")], "requeue", State.DONE,
        must=("Release",)),
    Row("3", lambda: adopted(False), [evs.Gone(verdict=NEVER)], "requeue", State.DONE,
        must=("Release", "RemoveRunDir")),
    Row("4", lambda: adopted(False), [evs.LockHeld(), HELLO(phase="ready"), CLAIMED], None,
        State.WAITING, must=("Connect", "Claim", "RecordRunning", "Wait")),
    Row("4-fresh", fresh, WAITING, None, State.WAITING,
        must=("RecordPid", "Connect", "Claim", "RecordRunning", "Wait")),
    Row("5", lambda: adopted(False), [evs.Gone(verdict=evs.NeverRan(reason="claim deadline"))],
        "requeue", State.DONE),
    Row("5-last-attempt", lambda: adopted(False, attempt=5),
        [evs.Gone(verdict=evs.NeverRan(reason="claim deadline"))], "failed", State.DONE,
        never=("Requeue",)),
    Row("6", lambda: adopted(False), [evs.LockHeld(), HELLO(phase="running"), CLAIMED], None,
        State.WAITING, must=("Claim", "RecordRunning", "Wait")),
    Row("7", lambda: adopted(True), [evs.LockHeld(), HELLO(phase="running"), CLAIMED], None,
        State.WAITING, must=("Claim", "Wait"), never=("RecordRunning",)),
    Row("8-live", lambda: adopted(True),
        [evs.LockHeld(), HELLO(phase="exited"), evs.ExitRecord(verdict=RESULT), evs.Acked()],
        "completed", State.DONE, must=("Wait", "Finalize", "Release", "Ack", "Disconnect"),
        never=("Claim",)),
    Row("8-sentinel", lambda: adopted(True), [evs.Gone(verdict=FAILED)], "failed", State.DONE,
        must=("Release", "RemoveRunDir")),
    Row("9", orphaned, [evs.AckFailed(refused=False), evs.Deadline(), evs.Acked()], None,
        State.DONE, must=("Retry", "Ack", "Disconnect"), never=("Finalize", "Release")),
    Row("10", orphaned, [evs.Gone(verdict=NEVER)], None, State.DONE, must=("RemoveRunDir",),
        never=("Finalize", "Release", "Requeue")),
    Row("11", fresh, [*CONNECTED, evs.Gone(verdict=NEVER)], "requeue", State.DONE),
    Row("11-spawn-failed", fresh, [evs.SpawnFailed(reason="no shell")], "failed", State.DONE,
        must=("Release", "RemoveRunDir")),
    Row("12", fresh, [*CLAIMING, evs.Gone(verdict=NEVER)], "requeue", State.DONE),
    Row("12b", lambda: adopted(False), [evs.NoRunDir(path="/r")], "requeue", State.DONE),
    Row("13", fresh, [*CLAIMING, evs.Gone(verdict=NEVER)], "requeue", State.DONE),
    Row("13a", fresh, [*CLAIMING, evs.LinkError(message="launch"), evs.Deadline(),
                       HELLO(phase="ready")], None, State.CLAIMING,
        must=("Retry", "Connect", "Claim"), never=("Finalize", "Release")),
    Row("13b", fresh, [*CLAIMING, evs.Gone(verdict=LOST)], "lost", State.DONE,
        must=("Kill", "Release", "RemoveRunDir")),
    Row("14", fresh, [*WAITING, evs.Gone(verdict=LOST)], "lost", State.DONE,
        must=("Kill", "Release")),
    Row("15", lambda: adopted(True), [evs.Gone(verdict=LOST)], "lost", State.DONE,
        must=("Kill",)),
    Row("16", fresh, [*WAITING, evs.Gone(verdict=RESULT)], "completed", State.DONE),
    Row("18", fresh, [*CONNECTED, evs.LinkError(message="hung"), evs.Deadline(),
                      evs.LinkError(message="hung"), evs.Deadline()], None, State.CONNECTING,
        never=("Finalize", "Release", "Requeue", "Kill")),
    Row("19", lambda: adopted(True), [evs.Gone(verdict=LOST)], "lost", State.DONE),
    Row("20-result", lambda: adopted(True), [evs.Gone(verdict=RESULT)], "completed",
        State.DONE),
    Row("20-running-no-manifest", lambda: adopted(True), [evs.Gone(verdict=NEVER)], "lost",
        State.DONE, must=("Kill",), never=("Requeue",)),
    Row("20-starting", lambda: adopted(False), [evs.Gone(verdict=NEVER)], "requeue",
        State.DONE),
    Row("21", lambda: adopted(True), [evs.Gone(verdict=RESULT)], "completed", State.DONE),
    Row("22-bad-manifest", lambda: adopted(False),
        [evs.Gone(verdict=evs.Lost(reason="manifest unusable"))], "lost", State.DONE,
        never=("Requeue",)),
    Row("22-forged-sentinel", fresh, [*WAITING, evs.Gone(verdict=evs.NeverRan(reason="forged"))],
        "lost", State.DONE, never=("Requeue",)),
    Row("23", fresh, [*CONNECTED, evs.LinkError(message="impostor"), evs.Deadline()], None,
        State.CONNECTING, must=("Retry", "Connect"), never=("Finalize", "Release")),
    Row("24", lambda: lc.adopt(7, 1, running=True, cancel=False),
        [evs.Conflict(reason="CPU 3 unknown")], "lost", State.DONE, never=("Release", "Kill")),
    Row("25", lambda: adopted(True), [evs.NoRunDir(path="/r")], "lost", State.DONE,
        never=("Requeue",)),
    # cancels (section 4)
    Row("cancel-ready", fresh, [*CONNECTED, evs.CancelRequested(), HELLO(phase="ready"),
                                evs.Terminated(phase="aborted")], "cancelled", State.DONE,
        must=("Terminate", "Release"), never=("Claim",)),
    Row("cancel-running", fresh, [*WAITING, evs.CancelRequested(),
                                  evs.ExitRecord(verdict=evs.Result(state="cancelled"))],
        "cancelled", State.ACKING, must=("Terminate", "Ack")),
    Row("cancel-lost", lambda: adopted(True, cancel=True), [evs.Gone(verdict=LOST)],
        "cancelled", State.DONE),
    Row("cancel-never-ran", lambda: adopted(False, cancel=True), [evs.Gone(verdict=NEVER)],
        "cancelled", State.DONE, never=("Requeue",)),
    Row("cancel-after-claim", fresh, [*CLAIMING, evs.CancelRequested(), CLAIMED], None,
        State.WAITING, must=("Terminate", "Wait")),
]


#: The rows that involve no machine, each with the test (real processes) that checks its outcome.
ELSEWHERE = {
    # a submit is one transaction; a pending job has no attempt and so no machine: after a
    # crash there is no job or one whole pending job (tests/integration/test_group_commit.py)
    "1": "test_a_submit_is_not_answered_before_its_sync",
    # the job is final and its directory half removed: the next start removes the rest and
    # changes nothing (tests/integration/test_crash_windows.py)
    "17": "test_a_half_removed_run_directory_of_an_ended_job_is_removed_and_nothing_else",
}


@pytest.mark.parametrize("row", ROWS, ids=[r.row for r in ROWS])
def test_crash_window(row: Row) -> None:
    m, effects = run(row.start(), row.events)
    names = kinds(effects)
    assert outcome(effects) == row.outcome, names
    if row.state is not None:
        assert m.state is row.state, m
    for k in row.must:
        assert k in names, (k, names)
    for k in row.never:
        assert k not in names, (k, names)


def _durable_first(effects: list[fx.Effect]) -> None:
    """Between two events, database writes precede every other effect but ``Kill``."""
    seen_other = False
    for e in effects:
        if isinstance(e, fx.DURABLE):
            assert not seen_other, kinds(effects)
        elif not isinstance(e, fx.Kill):
            seen_other = True


def _tests_dir() -> str:
    """tests/, however the tests below it are split (tests/unit/, tests/integration/)."""
    import os
    top = os.path.dirname(os.path.abspath(__file__))
    while os.path.basename(top) != "tests":
        top = os.path.dirname(top)
    return top


def test_every_row_of_the_architecture_table_is_here() -> None:
    import os
    import re
    doc = os.path.join(os.path.dirname(_tests_dir()), "docs", "architecture.md")
    with open(doc) as f:
        text = f.read()
    section = text[text.index("## 7. Crash windows"):text.index("## 8.")]
    documented = set(re.findall(r"^\| (\d+[a-z]?) \|", section, re.M))
    covered = {r.row.split("-")[0] for r in ROWS} | set(ELSEWHERE)
    assert documented and documented <= covered, sorted(documented - covered)


def test_every_row_checked_elsewhere_names_a_test_that_exists() -> None:
    import os
    import re
    defined: set[str] = set()
    for where, _, files in os.walk(_tests_dir()):
        for name in files:
            if re.fullmatch(r"test_\w+\.py", name):
                with open(os.path.join(where, name)) as f:
                    defined |= set(re.findall(r"^def (test_\w+)\(", f.read(), re.M))
    missing = {row: t for row, t in ELSEWHERE.items() if t not in defined}
    assert not missing, missing


# ---- invariants on random event sequences ----------------------------------------------------

VERDICTS: list[evs.Verdict] = [RESULT, FAILED, NEVER, LOST, evs.Result(state="cancelled"),
                              evs.NeverRan(reason="aborted")]


def random_event(rng: random.Random) -> evs.Event:
    pick = rng.randrange(17)
    return [
        lambda: evs.Spawned(pid=rng.randrange(1, 99)),
        lambda: evs.SpawnFailed(reason="x"),
        lambda: HELLO(phase=rng.choice(["ready", "running", "draining", "exited", "aborted"])),
        lambda: CLAIMED,
        lambda: evs.WaitTimedOut(),
        lambda: evs.ExitRecord(verdict=rng.choice(VERDICTS)),
        lambda: evs.Terminated(phase=rng.choice(["aborted", "running"])),
        lambda: evs.Acked(),
        lambda: evs.AckFailed(refused=rng.random() < 0.5),
        lambda: evs.LinkError(message="x"),
        lambda: evs.Gone(verdict=rng.choice(VERDICTS)),
        lambda: evs.CancelRequested(),
        lambda: evs.Deadline(),
        lambda: evs.Conflict(reason="x"),
        lambda: evs.Restored(),
        lambda: evs.NoRunDir(path="/r"),
        lambda: evs.LockHeld(),
    ][pick]()


def random_machine(rng: random.Random) -> tuple[lc.Machine, list[fx.Effect]]:
    attempt = rng.randrange(1, lc.MAX_ATTEMPTS + 2)
    kind = rng.randrange(4)
    if kind == 0:
        return lc.start(1, attempt, cancel=rng.random() < 0.2)
    if kind == 3:
        return lc.orphan(1, attempt)
    return lc.adopt(1, attempt, running=kind == 2, cancel=rng.random() < 0.2), []


@pytest.mark.parametrize("seed", range(40))
def test_invariants_hold_on_random_event_sequences(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(100):
        m, effects = random_machine(rng)
        held = m.holding
        settled_before = m.settled
        finalized = requeued = released = spawns = 0
        spawns += kinds(effects).count("Spawn")
        for _ in range(rng.randrange(1, 40)):
            ev = random_event(rng)
            before = m
            m, effects = lc.step(m, ev)
            names = kinds(effects)
            if before.final:
                assert m is before and effects == [], (before, ev)
                continue
            held = held or m.holding
            if before.launched:
                assert m.launched, "launched is never forgotten"
                assert "Requeue" not in names, (before, ev)  # an attempt never runs twice
            if before.settled:
                assert not {"Finalize", "Requeue", "Release", "Claim", "Spawn"} & set(names), \
                    (before, ev, names)
            finalized += names.count("Finalize")
            requeued += names.count("Requeue")
            released += names.count("Release")
            spawns += names.count("Spawn")
            if "Release" in names:
                assert "Finalize" in names or "Requeue" in names, (before, ev, names)
                first_release = names.index("Release")
                durable = [i for i, e in enumerate(effects) if isinstance(e, fx.DURABLE)]
                assert all(i < first_release for i in durable), names
        assert finalized + requeued <= 1, "an attempt is settled at most once"
        assert spawns <= 1
        if settled_before:
            assert finalized + requeued == 0
        if m.settled and not settled_before and held:
            assert released == 1, "a held allocation is released exactly once"
        else:
            assert released == 0 or (held and released == 1)
        if not held:
            assert released == 0


def test_a_final_machine_takes_no_event() -> None:
    m, _ = run(fresh(), [evs.SpawnFailed(reason="x")])
    assert m.final
    rng = random.Random(1)
    for _ in range(200):
        assert lc.step(m, random_event(rng)) == (m, [])


def test_durable_effects_come_first_in_every_transition() -> None:
    """A failed database write leaves nothing half done (the agent retries the event)."""
    rng = random.Random(2)
    for _ in range(3000):
        m, _ = random_machine(rng)
        for _ in range(rng.randrange(0, 8)):
            m, _ = lc.step(m, random_event(rng))
        _, effects = lc.step(m, random_event(rng))
        _durable_first(effects)
