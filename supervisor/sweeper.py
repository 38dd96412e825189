"""Reading /proc for the supervisor's loop: the scan for the step's leftover processes while it
drains, and the scans behind ``pids`` and ``stats``.

Leftovers (``Sweeper``). Once every task leader has been reaped the step drains: daemons that
left their task's process group were re-parented to the supervisor (a child subreaper) and must
be killed before the exit record is written. Why the loop kills and never anything else: a pid is
only safe to signal while it is an unreaped child of ours (its number cannot be handed to
another process before we reap it). A reap after the children were read asks for another look
(``again``): a daemon's own children are re-parented to us when it dies, i.e. before its reap,
possibly after we looked; pids reaped since the look began (``reaped``) are never signalled.

Where the kernel has ``/proc/PID/task/TID/children`` (CONFIG_PROC_CHILDREN) the sweeper reads
our own children there, on the loop: a few small files, whatever the number of processes on
the machine. A child belongs to the thread that forked it and an orphan to the first live
thread of its new parent: every one of ours is read, and only the loop's thread forks (the
others never have children, so none can move between threads while we read). The result is
handed to ``swept`` on the loop's next turn, like a thread's, so reaps in between count.

Elsewhere (and with the ``proc-scan`` test fault) it reads every ``/proc/PID/stat`` on the
machine, which takes tens of milliseconds on a busy node and more when ``/proc`` is slow: too
long for the one loop that also answers the agent, the CLI and the PMI ranks. So a thread reads
``/proc`` (``Scan``) and hands the result back through a socketpair the loop polls. One scan at
a time per kind; a request for a scan made while one runs gets the next one, never a result
older than itself. The loop reaps concurrently with the thread's scan, so every pid the scan
found that the loop has not reaped since is still our child, alive or a zombie, whatever the
delay.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from tether.shared.procid import all_processes, children
from tether.shared.wakeup import Wakeup

#: test-only faults (``TETHER_SUPERVISOR_FAULT``): the scan thread, its scan done, creates
#: ``sweep.held`` (``scan.held``) in the run directory and waits for ``sweep.go`` (``scan.go``)
HOLD = "hold-sweep"
HOLD_SCAN = "hold-scan"
#: test-only fault: scan all of /proc on a thread, as where the kernel has no children files
PROC_SCAN = "proc-scan"

T = TypeVar("T")


@dataclass(frozen=True)
class Found:
    pid: int
    dead: bool  # a zombie: counted (it is still to be reaped) but not signalled


class Scan(Generic[T]):
    """``read()`` on a thread, one at a time; the loop polls ``fileno`` and takes ``result``."""

    def __init__(self, read: Callable[[], T], hold: tuple[str, str] | None = None) -> None:
        self.read = read
        #: test fault: (directory, name): the thread, its scan done, waits (``hold``)
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
                hold(*self.hold)
        except BaseException as exc:  # handed to the loop, which decides
            self.error = exc
        self.wakeup.kick()


def scan_children(me: int) -> list[Found]:
    """Our children, from every process's /proc/PID/stat (I/O, O(processes on the machine))."""
    return [Found(st.pid, st.dead) for st in all_processes() if st.ppid == me]


def read_children(me: int) -> list[Found]:
    """Our children, from our threads' children files (I/O, O(threads + children)); on the
    loop, so nothing reaps meanwhile: ``waitid(WNOWAIT)`` tells the zombies. The full scan if
    the files cannot be read after all."""
    pids = children(me)
    if pids is None:
        return scan_children(me)
    found = []
    for pid in pids:
        try:
            dead = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped since it was listed: not ours any more
            continue
        found.append(Found(pid, dead))
    return found


def children_files() -> bool:
    """Does this kernel have /proc/PID/task/TID/children?"""
    return os.path.exists(f"/proc/self/task/{threading.get_native_id()}/children")


class Sweeper(Scan[list[Found]]):
    """The look for leftover children: what it found, less what the loop reaped meanwhile.

    ``inline``: read on the loop from the children files, the result handed over through the
    same wakeup on the loop's next turn; otherwise a thread's scan of all of /proc."""

    def __init__(self, hold_dir: str | None = None, *, inline: bool = True) -> None:
        me = os.getpid()
        self.inline = inline and hold_dir is None
        super().__init__(lambda: read_children(me) if self.inline else scan_children(me),
                         None if hold_dir is None else (hold_dir, "sweep"))
        #: pids the loop reaped since the running (or pending) look began: never signalled
        self.reaped: set[int] = set()
        #: inline: a result is waiting for the loop's next turn
        self.pending = False

    @property
    def busy(self) -> bool:
        return self.pending or self.thread is not None

    def start(self) -> None:
        if not self.inline:
            if self.thread is None:
                self.reaped = set()
            super().start()
            return
        # Read now: a fresh look supersedes a pending one (it began later, so what was reaped
        # before it is no longer among our children).
        self.again = False
        self.reaped = set()
        self.error = None
        try:
            self.value = self.read()
        except OSError as exc:
            self.value, self.error = None, exc
        self.pending = True
        self.wakeup.kick()

    def note_reaped(self, pid: int) -> None:
        if self.busy:
            self.reaped.add(pid)
            self.again = True

    def result(self) -> list[Found]:
        if self.inline:
            self.wakeup.drain()
            self.pending = False
            if self.error is not None:
                raise self.error
            assert self.value is not None
            found = self.value
        else:
            found = super().result()
        return [f for f in found if f.pid not in self.reaped]


def hold(directory: str, name: str) -> None:
    with open(os.path.join(directory, f"{name}.held"), "w"):
        pass
    while not os.path.exists(os.path.join(directory, f"{name}.go")):
        time.sleep(0.02)
