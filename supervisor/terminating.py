"""The time limit's account: how much longer it waits for the time the job spent suspended.

What ending a running step takes (SIGTERM, SIGKILL after the grace, the time limit, a fence) is
machine.py's to decide and effects.py's to carry out. The time limit is counted by this process
from the launch, since the agent may be gone when it runs out, and it moves on by the time the job
spent suspended (the agent's account in the run directory): read here when its timer fires, and
fed to the machine as ``TimeLimit.owed``. A mixin of ``service.Supervisor``; its state is
``state.py``'s.
"""

from __future__ import annotations

import time

from tether.shared import records
from tether.supervisor.state import SupervisorState


class Terminating(SupervisorState):
    """The account behind the time limit."""

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
