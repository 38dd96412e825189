"""Making a running step end: terminate (SIGTERM, then SIGKILL after a grace) and the time limit.

The time limit is counted by the supervisor from the launch, since the agent may be gone when it
runs out, and it moves on by the time the job spent suspended (the agent's account in the run
directory). A mixin of ``service.Supervisor``; its state is ``state.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time

from tether.shared import records
from tether.shared.step_cgroup import CgroupError
from tether.supervisor.state import SupervisorState, killpg
from tether.supervisor.step import Phase

log = logging.getLogger("tether.supervisor")


class Terminating(SupervisorState):
    """Ending a running step: SIGTERM, SIGKILL after the grace, the time limit."""

    def terminate(self, *, grace: float, cancel: bool, why: str) -> None:
        phase = self.step.phase
        if phase is Phase.READY:
            self.abort(why, cancel=cancel, keep_record=False)
            return
        if phase is not Phase.RUNNING:
            return
        if cancel:
            self.step.cancelled = True
        elif self.step.terminated_by is None:
            self.step.terminated_by = why
        for pid in self.step.live_pids():
            killpg(pid, signal.SIGTERM)
        if self.cgroup.active:
            # every process of the step hears it (a setsid daemon too); a suspended step is
            # thawed so that it can
            self.cgroup.signal_all(signal.SIGTERM)
            with contextlib.suppress(CgroupError):
                self.cgroup.thaw()
        if self.kill_timer is None:
            self.kill_timer = self.timers.at(time.monotonic() + grace, self.kill_now)
            log.info("%s: sent SIGTERM, SIGKILL in %gs", why, grace)

    def time_limit_reached(self) -> None:
        self.limit_timer = None
        if self.step.phase is not Phase.RUNNING or self.step.cancelled:
            return
        more = self.suspension_owed()
        if more > 0:  # time suspended is not run time: the limit moves on
            log.debug("time limit: %.1fs more for the time the job was suspended", more)
            self.limit_timer = self.timers.at(time.monotonic() + more, self.time_limit_reached)
            return
        limit = float(self.spec["time_limit"])
        self.step.timed_out = True
        self.terminate(grace=float(self.spec.get("kill_grace", 10)), cancel=False,
                       why=f"time limit of {_limit_text(limit)} reached")

    def suspension_owed(self) -> float:
        """How much longer the time limit must wait because the job was suspended: time
        suspended is not run time. The agent freezes the step and keeps the account in the run
        directory (``suspension.json``: seconds in all, and since when while suspended). While
        suspended: look again in a second. 0 when none is owed (or no account is readable)."""
        launched = getattr(self.step, "launched_mono", None)
        try:
            rec = records.read_json(self.rd.suspension, max_bytes=4096)
            seconds = float(rec.get("seconds", 0))
            since = rec.get("since")
        except (OSError, ValueError, TypeError, records.RecordError):
            return 0.0
        if since is not None and self.cgroup.active and self.cgroup.frozen():
            return 1.0
        if launched is None:
            return 0.0
        ran = time.monotonic() - launched - seconds
        owed = float(self.spec["time_limit"]) - ran
        return owed if owed > 0.01 else 0.0

    def kill_now(self) -> None:
        for task in self.step.tasks:
            if task.pid and not task.done:
                log.warning("task %d (pid %d) outlived the grace period; sending SIGKILL",
                            task.rank, task.pid)
                killpg(task.pid, signal.SIGKILL)
        self.kill_cgroup()


def _limit_text(seconds: float) -> str:
    """A limit as Slurm prints one, [D-]HH:MM:SS (fractions of a second, from tests, kept)."""
    s = int(seconds)
    text = f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    if s >= 86400:
        text = f"{s // 86400}-{s % 86400 // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return text if seconds == s else f"{seconds:g}s"
