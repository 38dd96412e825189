"""One step as its supervisor drives it: states, the machine, the transition table. Pure.

Theory of operation. What happens to a step comes in as events (machine_events.py): the agent's
claim, abort, terminate and ack, the claim deadline, the output files opened, the ``launching``
manifest written or not, the time limit, the kill timer, a fence, the last task reaped, the drain
over, the exit record written or not, the linger. ``step(machine, event)`` returns the next
machine and the effects (machine_effects.py) to carry out, in order; effects.py carries them out
and feeds back what they learn. This module does no I/O, reads no clock, holds no socket: it is
the agent's ``lifecycle.py`` for the supervisor's side.

States (``PHASE`` below says which phase of step.py each one is):

    ready -claim-> claimed -files, launching manifest-> running -terminate-> terminating
      |               |                                   |                     |
      +-abort/deadline+-> aborted -> gone                 +--last task reaped---+-> draining
    draining -leftovers gone-> ended -ack-> acked -followers done-> gone
                                 +--linger, record durable--> gone

Crash windows on the supervisor's side (docs/architecture.md, sections 4b and 7;
tests/unit/test_supervisor_machine.py checks each as a row of a table):
  - no task is forked before the ``launching`` manifest is durable: ``Fork`` only follows
    ``LaunchRecorded``, which effects.py feeds only after that write, so a supervisor that dies
    before it leaves "never ran" (requeued) and one that dies after it "lost" (never run twice);
  - the exit record is written before anyone is told the step ended (``WriteRecord`` precedes
    ``Announce`` and ``ReleaseWaiters`` in the same list);
  - the process leaves a step that ran only once the agent acknowledged it or its record is
    durable (the linger waits for the disk): the result is never only in a dead process;
  - a claim deadline keeps its "never started" sentinel; only the agent's own abort (it knows)
    removes the run directory of a step that never ran;
  - nothing moves a machine out of ``gone``, and the phase moves only as step.py's ``NEXT``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace

from tether.supervisor.machine_effects import (
    Announce,
    AnswerClaims,
    ArmTimer,
    CancelTimer,
    DiscardFiles,
    Effect,
    Exit,
    FailClaims,
    FailStep,
    Finish,
    Fork,
    KillOpener,
    KillTasks,
    NoteAbort,
    ParkClaim,
    Reap,
    RecordLaunching,
    ReleaseWaiters,
    RemoveRunDir,
    StartFencing,
    StartOpener,
    Terminate,
    WriteRecord,
)
from tether.supervisor.machine_events import (
    AbortRequested,
    Acked,
    AckLingerCheck,
    AllReaped,
    ClaimExpired,
    ClaimRequested,
    Drained,
    Fenced,
    FilesOpened,
    KillTimer,
    LaunchNotRecorded,
    LaunchRecorded,
    LingerExpired,
    RecordWritten,
    StepEvent,
    TerminateRequested,
    TimeLimit,
)
from tether.supervisor.step import Phase

#: How long to wait for killed leftovers to be reaped before writing the record anyway.
DRAIN_TIMEOUT = 10.0
#: seconds between attempts to write an exit record that could not be written (a full disk)
RECORD_RETRY = 1.0
#: How often, while acknowledged, the machine asks whether followers still read.
ACK_POLL = 0.05


class State(enum.Enum):
    READY = "ready"              # bound; waiting for the agent's claim (its deadline runs)
    CLAIMED = "claimed"          # claimed: the job's files are being opened, then recorded
    RUNNING = "running"          # tasks forked
    TERMINATING = "terminating"  # SIGTERM sent; SIGKILL when the kill timer fires
    DRAINING = "draining"        # the last task reaped; leftovers being killed
    ENDED = "ended"              # the exit record is out; waiting for the agent's ack
    ABORTED = "aborted"          # given up before the launch: nothing ran
    ACKED = "acked"              # the agent has the result; followers may still read
    GONE = "gone"                # the loop stops (final)


#: the step's phase (step.py, what every reply and record says) in each state; ``gone`` keeps
#: the phase it was reached from
PHASE: dict[State, Phase] = {
    State.READY: Phase.READY, State.CLAIMED: Phase.READY, State.RUNNING: Phase.RUNNING,
    State.TERMINATING: Phase.RUNNING, State.DRAINING: Phase.DRAINING, State.ENDED: Phase.EXITED,
    State.ABORTED: Phase.ABORTED,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Machine:
    state: State
    #: the step's phase (step.py); in ``acked`` and ``gone``, the one it ended in
    phase: Phase
    cancelled: bool = False
    #: its time limit ran out and it was told to stop
    timed_out: bool = False
    #: the first reason it was told to stop for (not a cancel)
    terminated_by: str | None = None
    #: the exit record is on disk (fsync'd and renamed into place)
    durable: bool = False

    @property
    def final(self) -> bool:
        return self.state is State.GONE

    def __repr__(self) -> str:
        flags = [n for n in ("cancelled", "timed_out", "durable") if getattr(self, n)]
        return f"<Machine {self.state.value} ({self.phase.value}) {' '.join(flags)}>"


def start() -> Machine:
    """A supervisor that just bound its sockets: ready, its claim deadline running."""
    return Machine(state=State.READY, phase=Phase.READY)


def resume(phase: Phase, *, cancelled: bool, timed_out: bool, terminated_by: str | None,
           durable: bool, terminating: bool) -> Machine:
    """The machine of a step handed over across an upgrade's exec (handover.py). A launch
    still opening files was given up before the exec: ``ready`` again, claimed anew."""
    state = {Phase.READY: State.READY, Phase.RUNNING: State.RUNNING,
             Phase.DRAINING: State.DRAINING, Phase.EXITED: State.ENDED,
             Phase.ABORTED: State.ABORTED}[phase]
    if state is State.RUNNING and terminating:
        state = State.TERMINATING
    return Machine(state=state, phase=phase, cancelled=cancelled, timed_out=timed_out,
                   terminated_by=terminated_by, durable=durable)


def _to(m: Machine, state: State, **changes: object) -> Machine:
    return replace(m, state=state, phase=PHASE.get(state, m.phase), **changes)  # type: ignore


# ---- transitions -----------------------------------------------------------------------------

Transition = Callable[[Machine, StepEvent], tuple[Machine, list[Effect]]]


def _claim(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """Park the claim; the first one stops the deadline and opens the files."""
    assert isinstance(ev, ClaimRequested)
    park = ParkClaim(peer=ev.peer, rid=ev.rid)
    if m.state is State.CLAIMED:
        return m, [park]
    # no deadline now, and no "ready" manifest: "launching" is what goes on disk next
    return _to(m, State.CLAIMED), [park, CancelTimer(name="claim"), CancelTimer(name="ready"),
                                   StartOpener()]


def _give_up(m: Machine, reason: str, *, cancel: bool,
             keep: bool) -> tuple[Machine, list[Effect]]:
    """Nothing ran. The agent's own abort takes the run directory with it (it knows); a claim
    deadline leaves the "never started" sentinel for an agent that may come back."""
    effects: list[Effect] = [NoteAbort(reason=reason, cancel=cancel), KillOpener(),
                             WriteRecord(keep=keep)]
    if not keep:
        effects.append(RemoveRunDir())
    effects += [AnswerClaims(), ReleaseWaiters(), Exit(why="aborted before launch")]
    return _to(_to(m, State.ABORTED, cancelled=cancel), State.GONE), effects


def _claim_expired(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """No claim in time: aborted, its never-started sentinel kept."""
    assert isinstance(ev, ClaimExpired)
    return _give_up(m, f"no agent claimed the step within {ev.timeout:g}s", cancel=False,
                    keep=True)


def _abort(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """The agent gives it up: aborted, its run directory goes."""
    assert isinstance(ev, AbortRequested)
    return _give_up(m, ev.reason, cancel=ev.cancel, keep=False)


def _terminate_unlaunched(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """Stopped before the launch: aborted as the agent's abort."""
    assert isinstance(ev, TerminateRequested)
    return _give_up(m, ev.why, cancel=ev.cancel, keep=False)


def _files_opened(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """Record the launch durably before any fork."""
    return m, [RecordLaunching()]


def _files_late(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """The files came in after the step was given up: nothing starts."""
    return m, [DiscardFiles(), AnswerClaims()]


def _not_recorded(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """Nothing starts: the claims fail, ready for another."""
    assert isinstance(ev, LaunchNotRecorded)
    return _to(m, State.READY), [KillOpener(), FailClaims(reason=ev.reason)]


def _recorded(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """Fork, arm the time limit, fence, answer the claims."""
    assert isinstance(ev, LaunchRecorded)
    effects: list[Effect] = []
    if ev.time_limit is not None and ev.time_limit > 0:
        effects.append(ArmTimer(name="limit", delay=ev.time_limit))
    return _to(m, State.RUNNING), [*effects, Fork(), StartFencing(), AnswerClaims(), Reap()]


def _terminate(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """SIGTERM now, SIGKILL after the first grace."""
    assert isinstance(ev, TerminateRequested)
    return _stop(m, why=ev.why, grace=ev.grace, cancel=ev.cancel)


def _stop(m: Machine, *, why: str, grace: float, cancel: bool,
          timed_out: bool = False) -> tuple[Machine, list[Effect]]:
    by = m.terminated_by if (cancel or m.terminated_by is not None) else why
    nxt = _to(m, State.TERMINATING, cancelled=m.cancelled or cancel, terminated_by=by,
              timed_out=m.timed_out or timed_out)
    effects: list[Effect] = [Terminate(why=why, grace=grace)]
    if m.state is not State.TERMINATING:  # one kill timer: the first grace stands
        effects.append(ArmTimer(name="kill", delay=grace))
    return nxt, effects


def _time_limit(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """Wait for the time suspended, else stop it as timed out."""
    assert isinstance(ev, TimeLimit)
    if m.cancelled:
        return m, []
    if ev.owed > 0:  # time suspended is not run time: the limit moves on
        return m, [ArmTimer(name="limit", delay=ev.owed)]
    return _stop(m, why=ev.why, grace=ev.grace, cancel=False, timed_out=True)


def _kill_timer(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """The grace is over: SIGKILL."""
    return m, [KillTasks(why="outlived the grace period")]


def _fenced(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """The lease ran out: fail and SIGKILL at once."""
    assert isinstance(ev, Fenced)
    # no grace: the cluster may run the job elsewhere soon; its reason is the step's story
    return replace(m, terminated_by=None), [FailStep(why=ev.why), KillTasks(why="fenced")]


def _all_reaped(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """Drain the leftovers, within DRAIN_TIMEOUT."""
    return _to(m, State.DRAINING), [CancelTimer(name="kill"), CancelTimer(name="limit"),
                                    ArmTimer(name="drain", delay=DRAIN_TIMEOUT)]


def _drained(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """Record the end, then tell everyone, then linger for the ack."""
    assert isinstance(ev, Drained)
    return _to(m, State.ENDED), [CancelTimer(name="drain"), Finish(), WriteRecord(), Announce(),
                                 ReleaseWaiters(), ArmTimer(name="linger", delay=ev.linger)]


def _record_written(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """The record's write: durable, or tried again while ended."""
    assert isinstance(ev, RecordWritten)
    if ev.ok:
        return replace(m, durable=True), []
    if m.state is State.ENDED:  # served from memory meanwhile; written again soon
        return m, [ArmTimer(name="record", delay=RECORD_RETRY)]
    return m, []  # acknowledged (the agent has it) or on the way out: nobody needs the file


def _linger_expired(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """No ack: exit if the record is durable, else stay."""
    assert isinstance(ev, LingerExpired)
    if not m.durable:  # the result exists only in this process: exiting would lose it
        return m, [ArmTimer(name="linger", delay=ev.linger)]
    return _to(m, State.GONE), [Exit(why="no agent acknowledged the result")]


def _acked(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """The run directory goes; exit, or wait for followers reading."""
    assert isinstance(ev, Acked)
    if ev.reading:
        return _to(m, State.ACKED), [RemoveRunDir(), CancelTimer(name="linger"),
                                     ArmTimer(name="ack", delay=ACK_POLL)]
    return _to(m, State.GONE), [RemoveRunDir(), Exit(why="acknowledged")]


def _ack_check(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """Exit once followers are done or the ack linger is over."""
    assert isinstance(ev, AckLingerCheck)
    if ev.reading and not ev.late:
        return m, [ArmTimer(name="ack", delay=ACK_POLL)]
    return _to(m, State.GONE), [Exit(why="followers done" if not ev.reading else
                                     "followers still reading after the ack linger")]


_UNLAUNCHED = (State.READY, State.CLAIMED)
_LAUNCHED = (State.RUNNING, State.TERMINATING)
_ENDED = (State.ENDED, State.ACKED)

#: (state, event type) -> transition. A pair that is absent leaves the machine as it is and
#: asks for nothing: an event the state no longer cares about (a timer that fired late).
TABLE: dict[tuple[State, type], Transition] = {
    (State.READY, ClaimRequested): _claim,
    (State.CLAIMED, ClaimRequested): _claim,
    (State.READY, ClaimExpired): _claim_expired,
    (State.CLAIMED, FilesOpened): _files_opened,
    (State.ABORTED, FilesOpened): _files_late,
    (State.GONE, FilesOpened): _files_late,
    (State.CLAIMED, LaunchNotRecorded): _not_recorded,
    (State.CLAIMED, LaunchRecorded): _recorded,
    (State.DRAINING, Drained): _drained,
    (State.ENDED, LingerExpired): _linger_expired,
    (State.ENDED, Acked): _acked,
    (State.ACKED, AckLingerCheck): _ack_check,
}
for _s in _UNLAUNCHED:
    TABLE[(_s, AbortRequested)] = _abort
    TABLE[(_s, TerminateRequested)] = _terminate_unlaunched
for _s in _LAUNCHED:
    TABLE[(_s, TerminateRequested)] = _terminate
    TABLE[(_s, TimeLimit)] = _time_limit
    TABLE[(_s, KillTimer)] = _kill_timer
    TABLE[(_s, Fenced)] = _fenced
    TABLE[(_s, AllReaped)] = _all_reaped
for _s in (*_ENDED, State.ABORTED, State.GONE):
    TABLE[(_s, RecordWritten)] = _record_written


def step(m: Machine, ev: StepEvent) -> tuple[Machine, list[Effect]]:
    """The next machine and the effects to carry out, in order. Pure."""
    move = TABLE.get((m.state, type(ev)))
    if move is None or (m.final and type(ev) is not RecordWritten
                        and type(ev) is not FilesOpened):
        return m, []
    return move(m, ev)
