"""What the lifecycle machine asks for: the effects a transition returns, in order. Pure data.

Each is a description; ``effects.py`` performs them. They live apart from the transition table
(``lifecycle.py``) so that the table reads as the decisions alone, and the agent's side can see
every effect it must know how to perform in one place. The ones that write the database
(``DURABLE``) come first in any list, ``Kill`` excepted (``lifecycle.py`` says why).
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.agent.lifecycle_events import Usage


@dataclass(frozen=True, slots=True, kw_only=True)
class Spawn:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class Connect:
    """Open a link if there is none and send ``hello``; ``fresh``: a just-spawned supervisor."""

    fresh: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class Wait:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class Terminate:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class Ack:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class Disconnect:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """Feed ``Deadline`` after the agent's retry interval."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordPid:
    pid: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordRunning:
    pids: tuple[int, ...]
    started_at: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Kill:
    """SIGKILL what is left of the step (by identity, session and process group)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Finalize:
    state: str  # completed, failed, cancelled or lost
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    core_dumped: bool = False
    #: the OOM killer took a process of the step
    oom: bool = False
    #: a PMI step none of whose ranks spoke PMI
    pmi_unused: bool = False
    #: what the step used (the accounting history's figures), if known
    usage: Usage | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Requeue:
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Release:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoveRunDir:
    pass


Effect = (Spawn | Connect | Claim | Wait | Terminate | Ack | Disconnect | Retry | RecordPid
          | RecordRunning | Kill | Finalize | Requeue | Release | RemoveRunDir)

#: effects that write the database; they come first in a transition's list
DURABLE = (RecordPid, RecordRunning, Finalize, Requeue)
