"""Finding the step's leftover processes off the supervisor's loop (I/O).

Once every task leader has been reaped the step drains: daemons that left their task's process
group were re-parented to the supervisor (a child subreaper) and must be killed before the
exit record is written. Finding them means reading every ``/proc/PID/stat`` on the machine,
which takes tens of milliseconds on a busy node and more when ``/proc`` is slow: too long for
the one loop that also answers the agent, the CLI and the PMI ranks. So a thread reads
``/proc`` and hands the pids back through a socketpair the loop polls; the loop kills.

Why the loop kills and not the thread: a pid is only safe to signal while it is an unreaped
child of ours (its number cannot be handed to another process before we reap it). The loop
reaps concurrently with the scan, so it remembers what it reaped since the scan began
(``reaped``) and skips those; every other pid the scan found is still our child, alive or a
zombie, whatever the delay.

One scan at a time; a reap during a scan asks for another (``again``): a daemon's own children
are re-parented to us only when it dies, after the scan may have passed them.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass

from tether.shared.procid import all_processes

#: test-only fault (``TETHER_SUPERVISOR_FAULT=hold-sweep``): the scan thread, its scan done,
#: creates ``sweep.held`` in the run directory and waits for ``sweep.go`` there
HOLD = "hold-sweep"


@dataclass(frozen=True)
class Found:
    pid: int
    dead: bool  # a zombie: counted (it is still to be reaped) but not signalled


class Sweeper:
    def __init__(self, hold_dir: str | None = None) -> None:
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.thread: threading.Thread | None = None
        self.found: list[Found] | None = None
        self.error: BaseException | None = None
        #: pids the loop reaped since the running scan began (never signalled afterwards)
        self.reaped: set[int] = set()
        #: a reap happened during the scan: its result may be stale, scan again
        self.again = False
        self.hold_dir = hold_dir

    def fileno(self) -> int:
        return self.wake_r.fileno()

    @property
    def busy(self) -> bool:
        return self.thread is not None

    def start(self) -> None:
        """Scan now, or once the running scan is in (it may have missed what was just reaped)."""
        if self.thread is not None:
            self.again = True
            return
        self.reaped = set()
        self.again = False
        self.found = None
        self.error = None
        self.thread = threading.Thread(target=self._scan, args=(os.getpid(),),
                                       name="tether-sweep", daemon=True)
        self.thread.start()

    def note_reaped(self, pid: int) -> None:
        if self.thread is not None:
            self.reaped.add(pid)
            self.again = True

    def result(self) -> list[Found]:
        """On the loop, once ``fileno`` is readable: the children still ours (not reaped since
        the scan began). Raises what the scan raised."""
        with contextlib.suppress(BlockingIOError):
            while self.wake_r.recv(64):
                pass
        assert self.thread is not None
        self.thread.join()
        self.thread = None
        if self.error is not None:
            raise self.error
        assert self.found is not None
        return [f for f in self.found if f.pid not in self.reaped]

    def close(self) -> None:
        self.wake_r.close()
        self.wake_w.close()

    def _scan(self, me: int) -> None:
        try:
            self.found = [Found(st.pid, st.dead) for st in all_processes() if st.ppid == me]
            if self.hold_dir is not None:
                _hold(self.hold_dir)
        except BaseException as exc:  # handed to the loop, which decides
            self.error = exc
        with contextlib.suppress(OSError):
            self.wake_w.send(b"x")


def _hold(run_dir: str) -> None:
    with open(os.path.join(run_dir, "sweep.held"), "w"):
        pass
    while not os.path.exists(os.path.join(run_dir, "sweep.go")):
        time.sleep(0.02)
