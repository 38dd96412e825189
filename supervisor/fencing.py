"""Self-fencing of a cluster job's step: its tasks die once the node's lease runs out.

The lease and why it exists are ``shared/lease.py``'s. The agent puts ``fence`` in the spec of
every step it runs for a cluster: the lease file and the heartbeat timeout. From the launch on,
this process reads the lease every second (a small file read; only cluster steps pay it) and,
once it is older than the timeout by this machine's clock, SIGKILLs every task and what else is
in the step's cgroup, and ends the step failed with a reason that starts with ``fenced``. There
is no grace: the cluster may start the job elsewhere a margin after the timeout, and a task that
took its time over SIGTERM would then overlap its next run.

The lease is last read value wins: a lease file that cannot be read (being replaced, the state
directory full) keeps the last renewal seen, so a passing read error neither fences nor delays
a fence. A mixin of ``service.Supervisor``; its state is ``state.py``'s.
"""

from __future__ import annotations

import logging
import time

from tether.shared import lease
from tether.supervisor.machine_events import Fenced
from tether.supervisor.state import SupervisorState
from tether.supervisor.step import Phase

log = logging.getLogger("tether.supervisor")

#: how often the lease is read, at most (a quarter of the timeout when that is shorter)
CHECK_EVERY = 1.0


class Fencing(SupervisorState):
    def start_fencing(self) -> None:
        """At the launch (and after an upgrade's exec): watch the lease if the spec says so."""
        fence = self.spec.get("fence")
        if not isinstance(fence, dict) or not isinstance(fence.get("lease"), str):
            return
        try:
            self.fence_after = float(fence["after"])
        except (KeyError, TypeError, ValueError):
            return
        self.fence_path = fence["lease"]
        self.fence_started = lease.now()
        self.lease_since = lease.read(self.fence_path)
        self.check_lease()

    def check_lease(self) -> None:
        self.fence_timer = None
        if self.step.phase is not Phase.RUNNING or self.fence_path is None:
            return
        seen = lease.read(self.fence_path)
        if seen is not None and (self.lease_since is None or seen > self.lease_since):
            self.lease_since = seen
        at = lease.now()
        if lease.expired(self.lease_since, self.fence_started, self.fence_after, at):
            self.fence(at)
            return
        every = min(CHECK_EVERY, self.fence_after / 4)
        self.fence_timer = self.timers.at(time.monotonic() + every, self.check_lease)

    def fence(self, at: float) -> None:
        since = self.lease_since if self.lease_since is not None else self.fence_started
        why = (f"{lease.FENCED}: this node's cluster lease is {at - since:.1f}s old (timeout "
               f"{self.fence_after:g}s): its agent could not confirm the node is still in the "
               "cluster, which may run the job elsewhere; the tasks were killed")
        self.feed(Fenced(why=why))
        self.emit("fenced", reason=why)
