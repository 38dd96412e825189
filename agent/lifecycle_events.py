"""What the lifecycle machine is fed: the events the agent learns about a (job, attempt), and the
verdicts two of them carry (what a supervisor or a run directory says became of it). Pure data.

They live apart from the transition table (``lifecycle.py``) so that the table reads as the
decisions alone. ``follow.py``, ``launcher.py`` and ``recovery.py`` make events of what they
see; ``fallback.py`` reads a run directory into a verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

# ---- what a run directory or a supervisor says happened ------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """What a step used, as its supervisor measured it at its end (the exit record's ``usage``):
    CPU seconds in user and system mode, the peak memory (KiB) and where that peak came from
    (``cgroup``: the step's cgroup counted it; ``rusage``: the largest task's own peak), and the
    largest task's peak resident set (KiB)."""

    cpu_user: float | None = None
    cpu_system: float | None = None
    maxrss_kb: int | None = None
    task_maxrss_kb: int | None = None
    source: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """A true result (the tasks were launched): from ``wait`` or from ``exit.json``."""

    state: str  # completed, failed or cancelled
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
    #: what the step used (accounting), if its supervisor said
    usage: Usage | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class NeverRan:
    """The attempt started no task (its supervisor aborted, or never launched)."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Lost:
    """The supervisor is gone and tasks may have run: no result will ever come."""

    reason: str
    kill: bool = True  # the step's leftovers are to be killed (a usable identity exists)


Verdict = Result | NeverRan | Lost


# ---- events ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Spawned:
    pid: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SpawnFailed:
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class HelloAnswered:
    phase: str  # ready, running, draining, exited, aborted


@dataclass(frozen=True, slots=True, kw_only=True)
class Claimed:
    pids: tuple[int, ...]
    started_at: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitTimedOut:
    """``wait`` answered ``done: false``: the step still runs."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExitRecord:
    """``wait`` answered with the step's exit record."""

    verdict: Result | NeverRan | Lost


@dataclass(frozen=True, slots=True, kw_only=True)
class Terminated:
    phase: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Acked:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class AckFailed:
    refused: bool  # an error reply (final) rather than a timeout (retried)
    message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkError:
    """A request failed while the run directory's lock is held: the supervisor lives."""

    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Gone:
    """The supervisor is gone (lock free); the run directory gave this verdict."""

    verdict: Result | NeverRan | Lost


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelRequested:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class Deadline:
    """A retry timer the machine asked for (``Retry``) has fired."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Conflict:
    """At reattach, the job's recorded allocation cannot be taken back."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Restored:
    """At reattach, the job's exact allocation is held again."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NoRunDir:
    path: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LockHeld:
    """At reattach, the run directory's lock is held: a supervisor lives; say hello."""


Event = (Spawned | SpawnFailed | HelloAnswered | Claimed | WaitTimedOut | ExitRecord | Terminated
         | Acked | AckFailed | LinkError | Gone | CancelRequested | Deadline | Conflict
         | Restored | NoRunDir | LockHeld)
