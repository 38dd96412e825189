"""Reading /proc off the supervisor's loop (I/O): the scan for the step's leftover processes
while it drains, and the scans behind ``pids`` and ``stats``.

Either reads every ``/proc/PID/stat`` on the machine, which takes tens of milliseconds on a busy
node and more when ``/proc`` is slow: too long for the one loop that also answers the agent, the
CLI and the PMI ranks. So a thread reads ``/proc`` (``Scan``) and hands the result back through
a socketpair the loop polls. One scan at a time per kind; a request for a scan made while one
runs gets the next one, never a result older than itself.

Leftovers (``Sweeper``). Once every task leader has been reaped the step drains: daemons that
left their task's process group were re-parented to the supervisor (a child subreaper) and must
be killed before the exit record is written. Why the loop kills and not the thread: a pid is
only safe to signal while it is an unreaped child of ours (its number cannot be handed to
another process before we reap it). The loop reaps concurrently with the scan, so it remembers
what it reaped since the scan began (``reaped``) and skips those; every other pid the scan found
is still our child, alive or a zombie, whatever the delay. A reap during a scan asks for another
(``again``): a daemon's own children are re-parented to us only when it dies, after the scan
may have passed them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from tether.shared.procid import all_processes
from tether.shared.wakeup import Wakeup

#: test-only faults (``TETHER_SUPERVISOR_FAULT``): the scan thread, its scan done, creates
#: ``sweep.held`` (``scan.held``) in the run directory and waits for ``sweep.go`` (``scan.go``)
HOLD = "hold-sweep"
HOLD_SCAN = "hold-scan"

T = TypeVar("T")


@dataclass(frozen=True)
class Found:
    pid: int
    dead: bool  # a zombie: counted (it is still to be reaped) but not signalled


class Scan(Generic[T]):
    """``read()`` on a thread, one at a time; the loop polls ``fileno`` and takes ``result``."""

    def __init__(self, read: Callable[[], T], hold: tuple[str, str] | None = None) -> None:
        self.read = read
        #: test fault: (directory, name): the thread, its scan done, waits (``_hold``)
        self.hold = hold
        self.wakeup = Wakeup()
        self.thread: threading.Thread | None = None
        self.value: T | None = None
        self.error: BaseException | None = None
        #: someone asked for a scan while one ran: it needs the next one
        self.again = False

    def fileno(self) -> int:
        return self.wakeup.fileno()

    @property
    def busy(self) -> bool:
        return self.thread is not None

    def start(self) -> None:
        """Scan now, or once the running scan is in (it began before this was asked)."""
        if self.thread is not None:
            self.again = True
            return
        self.again = False
        self.value = None
        self.error = None
        self.thread = threading.Thread(target=self._run, name="tether-scan", daemon=True)
        self.thread.start()

    def result(self) -> T:
        """On the loop, once ``fileno`` is readable. Raises what the scan raised."""
        self.wakeup.drain()
        assert self.thread is not None
        self.thread.join()
        self.thread = None
        if self.error is not None:
            raise self.error
        assert self.value is not None  # set by _run when it raised nothing
        return self.value

    def close(self) -> None:
        self.wakeup.close()

    def _run(self) -> None:
        try:
            self.value = self.read()
            if self.hold is not None:
                _hold(*self.hold)
        except BaseException as exc:  # handed to the loop, which decides
            self.error = exc
        self.wakeup.kick()


def children(me: int) -> list[Found]:
    return [Found(st.pid, st.dead) for st in all_processes() if st.ppid == me]


class Sweeper(Scan[list[Found]]):
    """The scan for leftover children: what it found, less what the loop reaped meanwhile."""

    def __init__(self, hold_dir: str | None = None) -> None:
        me = os.getpid()
        super().__init__(lambda: children(me), None if hold_dir is None else (hold_dir, "sweep"))
        #: pids the loop reaped since the running scan began (never signalled afterwards)
        self.reaped: set[int] = set()

    def start(self) -> None:
        if self.thread is None:
            self.reaped = set()
        super().start()

    def note_reaped(self, pid: int) -> None:
        if self.thread is not None:
            self.reaped.add(pid)
            self.again = True

    def result(self) -> list[Found]:
        return [f for f in super().result() if f.pid not in self.reaped]


def _hold(directory: str, name: str) -> None:
    with open(os.path.join(directory, f"{name}.held"), "w"):
        pass
    while not os.path.exists(os.path.join(directory, f"{name}.go")):
        time.sleep(0.02)
