"""One (job, attempt) as the agent sees it: states, the machine, the transition table. Pure.

Theory of operation. The agent's knowledge of a step comes in as events: a spawn that worked or
failed, replies to ``hello``, ``claim``, ``wait``, ``terminate`` and ``ack``, a request that
failed while the supervisor still holds its run directory's lock (``LinkError``), the supervisor
found gone with the run directory's verdict (``Gone``), a cancel, a retry deadline, and at
reattach what the agent found (``Conflict``, ``Restored``, ``NoRunDir``, ``LockHeld``); they
and the verdicts they carry are in ``lifecycle_events.py``, the effects in
``lifecycle_effects.py``, so that this module holds the decisions alone.
``step(machine, event)`` returns the next machine and the effects the agent must perform, in
order. The agent (``effects.py``) performs them and feeds what it learns back; this module does
no I/O, reads no clock and holds no reference to a socket.

Effects that change the database come first in any list (``Kill`` excepted: killing a lost
step's leftovers is idempotent), so when such a write fails (a full state directory) the agent
keeps the old machine and feeds the same event again later: nothing else was done yet.

Invariants (``tests/unit/test_lifecycle.py`` checks them on random event sequences):
  - ``Finalize`` is emitted at most once per machine, ``Requeue`` at most once, never both;
  - ``Release`` is emitted exactly once for a machine that held an allocation and reaches a
    final state by finalizing or requeueing, never for one that did not hold it;
  - no event moves a machine out of ``DONE``;
  - ``Requeue`` (the attempt never ran) is never emitted once the attempt is known to have
    launched (a claim was answered, the database says ``running``, or a record says so), so no
    attempt runs twice.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace

from tether.agent.lifecycle_effects import (
    Ack,
    Claim,
    Connect,
    Disconnect,
    Effect,
    Finalize,
    Kill,
    RecordPid,
    RecordRunning,
    Release,
    RemoveRunDir,
    Requeue,
    Retry,
    Spawn,
    Terminate,
    Wait,
)
from tether.agent.lifecycle_events import (
    Acked,
    AckFailed,
    CancelRequested,
    Claimed,
    Conflict,
    Deadline,
    Event,
    ExitRecord,
    Gone,
    HelloAnswered,
    LinkError,
    LockHeld,
    NeverRan,
    NoRunDir,
    Restored,
    Result,
    Spawned,
    SpawnFailed,
    Terminated,
    Verdict,
    WaitTimedOut,
)

#: attempts after which a job whose supervisor never started is failed rather than requeued
MAX_ATTEMPTS = 5
#: how the reason of a job failed because its supervisor never started begins (a cluster's
#: member gives such a run back to the queue: it never ran; cluster.py)
NEVER_STARTED = "never started"
COULD_NOT_START = "could not start its supervisor"
UNSTARTED = (NEVER_STARTED, COULD_NOT_START)


class State(enum.Enum):
    ADOPTING = "adopting"          # found active at agent start; facts being gathered
    STARTING = "starting"          # allocation recorded; the supervisor is being spawned
    CONNECTING = "connecting"      # hello in flight
    CLAIMING = "claiming"          # claim in flight
    WAITING = "waiting"            # launch confirmed (or the step ended): wait in flight
    UNRESPONSIVE = "unresponsive"  # its lock is held but it does not answer: retry at Deadline
    ACKING = "acking"              # the outcome is recorded; ack in flight (or retried)
    DONE = "done"                  # final: nothing left to tell anyone


FINAL_STATES = frozenset({State.DONE})


# ---- the machine -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Machine:
    job: int
    attempt: int
    state: State
    #: the attempt is known to have launched tasks (claim answered, db ``running``, a record)
    launched: bool = False
    #: a cancel was requested (durable in the database before it is fed)
    cancel: bool = False
    #: the job's allocation is in the ledger
    holding: bool = False
    #: the job has a final state or went back to the queue (its outcome is recorded)
    settled: bool = False

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    def __repr__(self) -> str:
        flags = [n for n in ("launched", "cancel", "holding", "settled") if getattr(self, n)]
        return f"<Machine job={self.job}.{self.attempt} {self.state.value} {' '.join(flags)}>"


def start(job: int, attempt: int, *, cancel: bool = False) -> tuple[Machine, list[Effect]]:
    """A new attempt scheduled: its allocation is taken and recorded (L1)."""
    return Machine(job=job, attempt=attempt, state=State.STARTING, holding=True,
                   cancel=cancel), [Spawn()]


def adopt(job: int, attempt: int, *, running: bool, cancel: bool) -> Machine:
    """An active attempt found in the database at agent start; nothing held yet."""
    return Machine(job=job, attempt=attempt, state=State.ADOPTING, launched=running,
                   cancel=cancel)


def orphan(job: int, attempt: int) -> tuple[Machine, list[Effect]]:
    """A final job whose supervisor still lives: C2 happened, C3 (ack) did not."""
    return Machine(job=job, attempt=attempt, state=State.ACKING, settled=True,
                   launched=True), [Ack()]


# ---- outcomes, shared by every path that settles an attempt ----------------------------------

def _finish(m: Machine, effects: list[Effect], state: State) -> tuple[Machine, list[Effect]]:
    if m.holding:
        effects.append(Release())
    return replace(m, state=state, holding=False, settled=True), effects


def _lose(m: Machine, reason: str, *, kill: bool, then: list[Effect],
          state: State) -> tuple[Machine, list[Effect]]:
    effects: list[Effect] = [Kill()] if kill else []
    if m.cancel:
        effects.append(Finalize(state="cancelled", reason=f"cancelled; {reason}"))
    else:
        effects.append(Finalize(state="lost", reason=reason))
    return _finish(replace(m, launched=True), effects + then, state)


def _never_ran(m: Machine, reason: str, *, then: list[Effect],
               state: State) -> tuple[Machine, list[Effect]]:
    if m.launched:
        # The launch was confirmed: requeueing would run the job twice.
        return _lose(m, f"{reason}, but it was recorded as running; it is not run again",
                     kill=True, then=then, state=state)
    if m.cancel:
        first: Effect = Finalize(state="cancelled", reason="cancelled before it started")
    elif m.attempt >= MAX_ATTEMPTS:
        first = Finalize(state="failed",
                         reason=f"{NEVER_STARTED} in {m.attempt} attempts; last: {reason}")
    else:
        first = Requeue(reason=reason)
    return _finish(m, [first, *then], state)


def _settle(m: Machine, verdict: Verdict, *, then: list[Effect],
            state: State) -> tuple[Machine, list[Effect]]:
    """Record what became of the attempt, once; an attempt already settled only moves on."""
    if m.settled:
        return replace(m, state=state), list(then)
    if isinstance(verdict, Result):
        fin = Finalize(state=verdict.state, exit_code=verdict.exit_code, signal=verdict.signal,
                       reason=verdict.reason, started_at=verdict.started_at,
                       ended_at=verdict.ended_at, core_dumped=verdict.core_dumped,
                       oom=verdict.oom, pmi_unused=verdict.pmi_unused, usage=verdict.usage)
        return _finish(replace(m, launched=True), [fin, *then], state)
    if isinstance(verdict, NeverRan):
        return _never_ran(m, verdict.reason, then=then, state=state)
    return _lose(m, verdict.reason, kill=verdict.kill, then=then, state=state)


# ---- transitions -----------------------------------------------------------------------------

Transition = Callable[[Machine, "Event"], tuple[Machine, list[Effect]]]


def _spawned(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    assert isinstance(ev, Spawned)
    return replace(m, state=State.CONNECTING), [RecordPid(pid=ev.pid), Connect(fresh=True)]


def _spawn_failed(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    assert isinstance(ev, SpawnFailed)
    fin = Finalize(state="failed", reason=f"{COULD_NOT_START}: {ev.reason}")
    return _finish(m, [fin, RemoveRunDir()], State.DONE)


def _hello(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    assert isinstance(ev, HelloAnswered)
    if ev.phase in ("exited", "aborted"):
        return replace(m, state=State.WAITING), [Wait()]
    if ev.phase == "ready" and m.cancel:
        return replace(m, state=State.CLAIMING), [Terminate()]
    return replace(m, state=State.CLAIMING), [Claim()]


def _claimed(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    assert isinstance(ev, Claimed)
    effects: list[Effect] = []
    if not m.launched:
        effects.append(RecordRunning(pids=ev.pids, started_at=ev.started_at))
    if m.cancel:
        effects.append(Terminate())
    effects.append(Wait())
    return replace(m, state=State.WAITING, launched=True), effects


def _wait_again(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    return m, [Wait()]


def _exit_record(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    assert isinstance(ev, ExitRecord)
    return _settle(m, ev.verdict, then=[Ack()], state=State.ACKING)


def _terminated(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    assert isinstance(ev, Terminated)
    if ev.phase != "aborted" or m.launched or m.settled:
        if m.state is State.CLAIMING:
            # Asked to stop instead of being claimed, it went on (it had launched already):
            # its result comes through wait.
            return replace(m, state=State.WAITING), [Wait()]
        return m, []
    # It aborted without starting anything and removes its own directory.
    return _settle(m, NeverRan(reason="cancelled before it started"),
                   then=[Disconnect(), RemoveRunDir()], state=State.DONE)


def _link_error(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    return replace(m, state=State.UNRESPONSIVE), [Retry()]


def _gone(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    assert isinstance(ev, Gone)
    return _settle(m, ev.verdict, then=[Disconnect(), RemoveRunDir()], state=State.DONE)


def _cancel_while_following(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    return replace(m, cancel=True), [Terminate()]


def _cancel_later(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    """Not following yet: the hello or claim path sees the flag and acts on it."""
    return replace(m, cancel=True), []


def _reconnect(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    return replace(m, state=State.CONNECTING), [Connect(fresh=False)]


def _acked(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    return replace(m, state=State.DONE), [Disconnect()]


def _ack_failed(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    assert isinstance(ev, AckFailed)
    if ev.refused:
        return replace(m, state=State.DONE), [Disconnect()]
    return m, [Disconnect(), Retry()]


def _ack_later(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    return m, [Disconnect(), Retry()]


def _ack_again(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    return m, [Ack()]


def _conflict(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    assert isinstance(ev, Conflict)
    reason = f"not adopted after an agent restart: allocation conflict: {ev.reason}"
    return _lose(m, reason, kill=False, then=[], state=State.DONE)


def _restored(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    return replace(m, holding=True), []


def _no_run_dir(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    assert isinstance(ev, NoRunDir)
    if m.launched:
        return _lose(m, f"its run directory {ev.path} disappeared while it ran", kill=True,
                     then=[], state=State.DONE)
    return _never_ran(m, "no run directory: it was never spawned, or its supervisor gave up "
                         "before launching", then=[], state=State.DONE)


def _lock_held(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    return replace(m, state=State.CONNECTING), [Connect(fresh=False)]


_FOLLOWING = (State.CONNECTING, State.CLAIMING, State.WAITING, State.UNRESPONSIVE)

#: (state, event type) -> transition. A pair that is absent leaves the machine as it is and
#: asks for nothing: a late reply from a request the machine no longer cares about.
TABLE: dict[tuple[State, type], Transition] = {
    (State.STARTING, Spawned): _spawned,
    (State.STARTING, SpawnFailed): _spawn_failed,
    (State.STARTING, CancelRequested): _cancel_later,
    (State.STARTING, Gone): _gone,  # it ended before it was ready (spawn.py's ready pipe)
    (State.ADOPTING, Conflict): _conflict,
    (State.ADOPTING, Restored): _restored,
    (State.ADOPTING, NoRunDir): _no_run_dir,
    (State.ADOPTING, LockHeld): _lock_held,
    (State.ADOPTING, Gone): _gone,
    (State.ADOPTING, CancelRequested): _cancel_later,
    (State.CONNECTING, HelloAnswered): _hello,
    (State.CONNECTING, CancelRequested): _cancel_later,
    (State.CLAIMING, Claimed): _claimed,
    (State.CLAIMING, Terminated): _terminated,
    (State.CLAIMING, CancelRequested): _cancel_while_following,
    (State.WAITING, WaitTimedOut): _wait_again,
    (State.WAITING, ExitRecord): _exit_record,
    (State.WAITING, Terminated): _terminated,
    (State.WAITING, CancelRequested): _cancel_while_following,
    (State.UNRESPONSIVE, Deadline): _reconnect,
    (State.UNRESPONSIVE, CancelRequested): _cancel_later,
    (State.ACKING, Acked): _acked,
    (State.ACKING, AckFailed): _ack_failed,
    (State.ACKING, LinkError): _ack_later,
    (State.ACKING, Deadline): _ack_again,
    (State.ACKING, Gone): _gone,
}
for _s in _FOLLOWING:
    TABLE[(_s, LinkError)] = _link_error
    TABLE[(_s, Gone)] = _gone


def step(m: Machine, ev: Event) -> tuple[Machine, list[Effect]]:
    """The next machine and the effects to perform, in order. Pure."""
    if m.final:
        return m, []
    move = TABLE.get((m.state, type(ev)))
    if move is None:
        return m, []
    return move(m, ev)
