"""What the supervisor's step machine is fed (machine.py), and what a request handler returns when
a request asks for more than a reply. Pure data.

Two kinds of events. The step's own (a claim, its deadline, the files opened, the launch, a
terminate, the time limit, the kill timer, the last task reaped, the drain over, the exit record
written or not, the linger, the ack, a fence) go through ``machine.step``, which decides. A
request's (a long poll to park, a /proc scan to wait for, an upgrade to check) are carried out by
the I/O side as they are (effects.py): they change no state of the step.

A handler (handlers*.py) reads a view of the supervisor and returns either the reply or an
``Act``: the events to feed, then the reply, so that no handler drives the supervisor itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# ---- the step's events (machine.py decides) ----------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimRequested:
    """The agent's claim of a ready step (parked by the I/O side until the launch answers)."""

    peer: Any
    rid: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimExpired:
    """No claim came within the spec's ``claim_timeout``."""

    timeout: float


@dataclass(frozen=True, slots=True, kw_only=True)
class FilesOpened:
    """The output opener handed back the job's files (or failed: the launch records why)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchNotRecorded:
    """The ``launching`` manifest could not be written, or an upgrade gives up a launch still
    opening files: nothing was started, and the claims are answered with ``reason``."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchRecorded:
    """The ``launching`` manifest is durable: tasks may be forked now. ``time_limit``: the
    spec's, counted from now by this process (the agent may be gone when it runs out)."""

    time_limit: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortRequested:
    """The agent gives the step up before its launch (``abort``, or ``terminate`` of a ready
    step): nothing ran, its run directory goes."""

    reason: str
    cancel: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class TerminateRequested:
    """Stop the step: SIGTERM now, SIGKILL after ``grace`` (the agent, or a signal to us)."""

    grace: float
    cancel: bool
    why: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeLimit:
    """The time limit's timer fired; ``owed``: seconds more for time spent suspended."""

    owed: float
    grace: float
    why: str


@dataclass(frozen=True, slots=True, kw_only=True)
class KillTimer:
    """The grace after SIGTERM is over."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Fenced:
    """A cluster step's lease ran out: its tasks die at once, the step fails for ``why``."""

    why: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AllReaped:
    """The last task was reaped."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Drained:
    """No leftover is left (or the drain's deadline passed): the step has ended. ``linger``:
    how long the spec says to wait for the agent's ack."""

    linger: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordWritten:
    """The exit record is durable (``ok``) or could not be written (a full disk)."""

    ok: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class LingerExpired:
    """No ack came within the spec's ``linger`` (which it carries, to wait again)."""

    linger: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Acked:
    """The agent recorded the result; ``reading``: a follower is still reading the output."""

    reading: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class AckLingerCheck:
    """While acknowledged: is a follower still reading, and is the ack linger over?"""

    reading: bool
    late: bool


StepEvent = (ClaimRequested | ClaimExpired | FilesOpened | LaunchNotRecorded | LaunchRecorded
             | AbortRequested | TerminateRequested | TimeLimit | KillTimer | Fenced | AllReaped
             | Drained | RecordWritten | LingerExpired | Acked | AckLingerCheck)


# ---- a request's own events (effects.py carries them out) ----------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitFor:
    """Park the agent's ``wait`` until the step ends (or ``hold`` runs out)."""

    peer: Any
    rid: Any
    hold: float


@dataclass(frozen=True, slots=True, kw_only=True)
class FollowOutput:
    peer: Any
    rid: Any
    streams: tuple[str, ...]
    offsets: dict[str, int]
    hold: float


@dataclass(frozen=True, slots=True, kw_only=True)
class FollowEvents:
    peer: Any
    rid: Any
    after: int
    hold: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamAnswered:
    """A follower was answered; ``ended``: it has read everything."""

    peer: Any
    verb: str
    ended: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ScanFor:
    """Answer with ``compute(processes)`` from a /proc scan that begins after the request."""

    peer: Any
    rid: Any
    compute: Callable[[Any], Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class AckRequested:
    """The agent's ``ack`` of an ended step (fed on as ``Acked`` with who still reads)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UpgradeRequested:
    """Check that the installed build takes over; re-exec once the reply is out."""


RequestEvent = (WaitFor | FollowOutput | FollowEvents | StreamAnswered | ScanFor | AckRequested
                | UpgradeRequested)
Event = StepEvent | RequestEvent


@dataclass(frozen=True, slots=True)
class Act:
    """A handler's answer when the request asks for more than a reply: feed ``events`` in
    order, then reply with ``reply`` (a value, ``state.PENDING``, or a function of the view
    called once the events are in)."""

    events: tuple[Event, ...]
    reply: Any = field(default=None)
