"""What the supervisor's step machine asks for (machine.py): the effects a transition returns, in
order. Pure data; effects.py carries them out.

The order is the crash-safety argument (docs/architecture.md, section 3): the ``launching``
manifest is durable before any fork (``RecordLaunching`` is an effect whose success comes back as
an event, and only that event leads to ``Fork``), and the exit record is written before anyone is
told the step ended (``WriteRecord`` before ``ReleaseWaiters``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the machine's timers; effects.py binds each name to the event it feeds when it fires
TIMERS = ("claim", "ready", "kill", "limit", "drain", "linger", "record", "ack")


@dataclass(frozen=True, slots=True, kw_only=True)
class ArmTimer:
    name: str
    delay: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelTimer:
    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ParkClaim:
    """Hold the claim until the launch answers it."""

    peer: Any
    rid: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class StartOpener:
    """Open the job's output files as its user (off the loop): ``FilesOpened`` when in."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KillOpener:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscardFiles:
    """The files came in after an abort: close them, start nothing."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordLaunching:
    """Write the ``launching`` manifest durably: ``LaunchRecorded`` or ``LaunchNotRecorded``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Fork:
    """Make the cgroup, fork the tasks, say ``running`` in the manifest, reap what failed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Reap:
    """Reap now: a task that failed to start has ended already."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StartFencing:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class AnswerClaims:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class FailClaims:
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class NoteAbort:
    """The step gives up before its launch for ``reason``: nothing ran."""

    reason: str
    cancel: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Terminate:
    """SIGTERM to every task's group and to the cgroup (thawed), logged with ``why``."""

    why: str
    grace: float


@dataclass(frozen=True, slots=True, kw_only=True)
class KillTasks:
    """SIGKILL every live task's group and the cgroup."""

    why: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FailStep:
    """The step fails for ``why``, whatever its tasks' exits say (a fence)."""

    why: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Finish:
    """Measure what the step used, note an OOM kill, stamp its end."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteRecord:
    """Build the exit record and write it (fsync, rename): ``RecordWritten``. ``keep``: False
    for a step given up by the agent, whose run directory goes (the record is served only)."""

    keep: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Announce:
    """The step ended: remove its cgroup, log its outcome, add the ``step_ended`` event."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseWaiters:
    """Answer the agent's parked ``wait`` with the record; every follower learns the end."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoveRunDir:
    """At exit, the run directory goes (the agent has the result, or nothing ever ran)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Exit:
    """Stop the loop: the process exits once the last reply is written."""

    why: str = ""


Effect = (ArmTimer | CancelTimer | ParkClaim | StartOpener | KillOpener | DiscardFiles
          | RecordLaunching | Fork | Reap | StartFencing | AnswerClaims | FailClaims | NoteAbort
          | Terminate | KillTasks | FailStep | Finish | WriteRecord | Announce | ReleaseWaiters
          | RemoveRunDir | Exit)
