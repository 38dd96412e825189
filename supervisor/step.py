"""The step as the supervisor knows it: its phase, its tasks and their exit statuses. Pure.

Phases move one way only:

    ready --claim--> running --last task reaped--> draining --leftovers gone--> exited
    ready --abort or claim deadline--> aborted

The result (``outcome``) is computed once, from the first task to fail: when one rank fails
and the step then kills the others, the killed ranks' SIGKILL is not the step's story.
"""

from __future__ import annotations

import enum
import os
import signal
from dataclasses import dataclass, field
from typing import Any


class Phase(enum.Enum):
    READY = "ready"
    RUNNING = "running"
    DRAINING = "draining"
    EXITED = "exited"
    ABORTED = "aborted"


#: the phases each phase may move to (docs/architecture.md section 3 is generated from it)
NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.READY: frozenset({Phase.RUNNING, Phase.ABORTED}),
    Phase.RUNNING: frozenset({Phase.DRAINING}),
    Phase.DRAINING: frozenset({Phase.EXITED}),
    Phase.EXITED: frozenset(),
    Phase.ABORTED: frozenset(),
}


class PhaseError(RuntimeError):
    pass


#: Longest reason kept per task and per step: the exit record must stay far below one frame
#: even with a thousand tasks (a reason may quote a 128 KiB command).
MAX_REASON = 300


def bounded(text: str) -> str:
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 3] + "..."


def signal_name(num: int) -> str:
    try:
        return str(signal.Signals(num).name)
    except ValueError:
        return f"signal {num}"


@dataclass
class Task:
    rank: int
    pid: int = 0
    start_ticks: int = 0
    exit_code: int | None = None
    signal: int | None = None
    core_dumped: bool = False
    utime: float = 0.0
    stime: float = 0.0
    maxrss_kb: int = 0
    reason: str | None = None
    done: bool = False
    #: the supervisor itself killed it (ending a failed PMI step): its SIGKILL is not the story
    killed_by_step: bool = False

    def record_status(self, status: int, rusage: Any | None) -> None:
        if os.WIFSIGNALED(status):
            self.signal = os.WTERMSIG(status)
            self.core_dumped = os.WCOREDUMP(status)
        else:
            self.exit_code = os.WEXITSTATUS(status)
        if rusage is not None:
            self.utime, self.stime = rusage.ru_utime, rusage.ru_stime
            self.maxrss_kb = rusage.ru_maxrss
        self.done = True

    def record_launch_failure(self, reason: str) -> None:
        self.exit_code, self.reason, self.done = 127, bounded(reason), True

    @property
    def failed(self) -> bool:
        return self.done and (self.signal is not None or self.exit_code != 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "pid": self.pid, "start_ticks": self.start_ticks,
            "alive": not self.done, "exit_code": self.exit_code, "signal": self.signal,
            "core_dumped": self.core_dumped, "utime": self.utime, "stime": self.stime,
            "maxrss_kb": self.maxrss_kb, "reason": self.reason,
        }


@dataclass
class Step:
    job: int
    attempt: int
    ntasks: int
    phase: Phase = Phase.READY
    tasks: list[Task] = field(default_factory=list)
    first_failure: Task | None = None
    cancelled: bool = False
    #: its time limit ran out and it was told to stop (state ``timeout``, unless cancelled)
    timed_out: bool = False
    terminated_by: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    abort_reason: str | None = None
    #: set when the step is failed from outside any one task's exit (PMI abort, broken fence)
    forced_reason: str | None = None
    forced_code: int | None = None
    #: the OOM killer took a process of the step, whose memory limit was this many MB
    oom_mb: int | None = None
    #: CLOCK_MONOTONIC at the launch, where the time limit counts from (system-wide: it
    #: holds across an upgrade's exec)
    launched_mono: float | None = None
    #: a PMI step whose ranks all ended without a word of PMI (pmi_loop.py, ``note_pmi_unused``)
    pmi_unused: bool = False
    #: what the step used in all, measured at its end (``usage_of``; the exit record's ``usage``)
    usage: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.tasks:
            self.tasks = [Task(rank=r) for r in range(self.ntasks)]

    def advance(self, to: Phase) -> None:
        if to not in NEXT[self.phase]:
            raise PhaseError(f"step {self.job}.{self.attempt} can't go from "
                             f"{self.phase.value} to {to.value}")
        self.phase = to

    def force_failure(self, reason: str, exit_code: int | None = None) -> bool:
        """Record why the step is being ended; the first reason stands. True if it was new."""
        if self.forced_reason is not None:
            return False
        self.forced_reason, self.forced_code = reason, exit_code
        return True

    def note_exit(self, task: Task) -> None:
        if task.failed and self.first_failure is None and not task.killed_by_step:
            self.first_failure = task

    @property
    def all_done(self) -> bool:
        return all(t.done for t in self.tasks)

    def live_pids(self) -> list[int]:
        return [t.pid for t in self.tasks if t.pid and not t.done]

    def job_state(self) -> str:
        """The state in the job object's vocabulary."""
        if self.phase is Phase.READY:
            return "starting"
        if self.phase in (Phase.RUNNING, Phase.DRAINING):
            return "running"
        if self.phase is Phase.ABORTED:
            return "cancelled" if self.cancelled else "pending"
        return str(self.outcome()["state"])

    def outcome(self) -> dict[str, Any]:
        """The step's result: the exit record's body."""
        if self.phase is Phase.ABORTED:
            return {"state": "aborted", "launched": False, "exit_code": None, "signal": None,
                    "reason": self.abort_reason}
        bad = self.first_failure
        if self.cancelled:
            state = "cancelled"
        elif self.timed_out:
            state = "timeout"
        elif bad is None:
            state = "completed"
        else:
            state = "failed"
        exit_code: int | None = 0
        sig: int | None = None
        reason = None
        if bad is not None:
            exit_code, sig = bad.exit_code, bad.signal
            if bad.reason:
                reason = bad.reason
            elif sig is not None:
                reason = f"task {bad.rank} (pid {bad.pid}) was killed by {signal_name(sig)}"
                if bad.core_dumped:
                    reason += " (core dumped)"
            elif self.ntasks > 1:
                reason = f"task {bad.rank} (pid {bad.pid}) exited with code {exit_code}"
        if self.forced_reason is not None and not (self.cancelled or self.timed_out):
            state, reason = "failed", self.forced_reason
            if self.forced_code is not None:
                exit_code, sig = self.forced_code, None
            elif bad is None:
                exit_code, sig = None, None
        if self.oom_mb is not None and not self.cancelled:
            # Whatever a task made of it (a shell may exit 1 after its child was killed), the
            # step ran out of memory: that is the story, and the exit is the OOM's SIGKILL
            # unless a task's own failure says more.
            state = "failed"
            if bad is None or bad.signal == signal.SIGKILL:
                exit_code, sig = None, int(signal.SIGKILL)
            reason = f"the step exceeded its memory limit of {self.oom_mb} MB" + (
                f" ({reason})" if reason else "")
        if self.cancelled:
            reason = "cancelled" + (f"; {reason}" if reason else "")
        elif self.terminated_by:
            reason = self.terminated_by + (f"; {reason}" if reason else "")
        return {"state": state, "launched": True, "exit_code": exit_code, "signal": sig,
                "oom": self.oom_mb is not None,
                **({"pmi_unused": True} if self.pmi_unused else {}),
                "core_dumped": bool(sig is not None and bad is not None and bad.core_dumped),
                "reason": None if reason is None else bounded(reason)}


def usage_of(tasks: list[Task], counted: dict[str, Any]) -> dict[str, Any]:
    """The exit record's ``usage``: CPU seconds (user, system) and the memory peak (KiB) from
    the step's cgroup (``counted``: StepCgroup.usage, empty without one), each figure it lacks
    from the tasks' rusage (each task and the children it waited for: a CPU sum, the largest
    peak resident set); ``task_maxrss_kb`` is that largest task's peak either way."""
    task_peak = max((t.maxrss_kb for t in tasks), default=0)
    user, system, peak = (counted.get(k) for k in ("cpu_user", "cpu_system", "memory_peak"))
    if user is None or system is None:
        user, system = sum(t.utime for t in tasks), sum(t.stime for t in tasks)
    return {"cpu_user": round(float(user), 3), "cpu_system": round(float(system), 3),
            "maxrss_kb": task_peak if peak is None else int(peak) // 1024,
            "task_maxrss_kb": task_peak, "source": "rusage" if peak is None else "cgroup"}
