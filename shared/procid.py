"""Process identity: (boot id, pid, start ticks), never a pid alone.

A pid is reused after its process is reaped; the start time (field 22 of /proc/PID/stat, clock
ticks since boot) is not, within one boot; the boot id tells boots apart, since ticks restart at
zero. A zombie still has a /proc entry, so a process in state Z or X counts as dead.
"""

from __future__ import annotations

import os
import time

from tether.shared.frozen import Frozen

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations only: typing costs a client's start ~5 ms
    from collections.abc import Iterator
    from typing import Any

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_boot_id: str | None = None
#: clock ticks per second (USER_HZ): the unit of field 22, the start time
CLK_TCK = os.sysconf("SC_CLK_TCK")
_TICK_NS = 1_000_000_000 // CLK_TCK


def boot_id() -> str:
    global _boot_id
    if _boot_id is None:
        with open(_BOOT_ID_PATH) as f:
            _boot_id = f.read().strip()
    return _boot_id


class ProcStat(Frozen):
    __slots__ = ("pid", "state", "ppid", "pgrp", "session", "start_ticks")
    pid: int
    state: str
    ppid: int
    pgrp: int
    session: int
    start_ticks: int

    def __init__(self, *, pid: int, state: str, ppid: int, pgrp: int, session: int,
                 start_ticks: int) -> None:
        self._init(pid=pid, state=state, ppid=ppid, pgrp=pgrp, session=session,
                   start_ticks=start_ticks)

    @property
    def dead(self) -> bool:
        return self.state in ("Z", "X", "x")


def proc_stat(pid: int) -> ProcStat | None:
    """Parse /proc/PID/stat, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm may contain spaces and ')' itself: everything after the *last* ')' is fixed fields.
    rest = raw[raw.rfind(b")") + 2 :].split()
    try:
        return ProcStat(
            pid=pid,
            state=rest[0].decode(),
            ppid=int(rest[1]),
            pgrp=int(rest[2]),
            session=int(rest[3]),
            start_ticks=int(rest[19]),
        )
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int) -> int | None:
    st = proc_stat(pid)
    return None if st is None else st.start_ticks


def boottime() -> float:
    """Seconds since boot on the clock that process start times are measured by."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def boot_ticks() -> int:
    """Now, in the unit of field 22: whole clock ticks of ``CLOCK_BOOTTIME``.

    The kernel stamps a new process's start with ``CLOCK_BOOTTIME`` during the fork, and
    /proc/PID/stat shows it rounded down to clock ticks (in the reader's time namespace, as
    this clock is read in it). So when ``boot_ticks()`` reads the same value just before and
    just after a fork, that value is the child's start ticks, exactly: no /proc read needed.
    Such a read right after a fork and exec blocks until the child's exec is through (1-4 ms
    for an MPI rank, measured; bench/README.md)."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // _TICK_NS


class ProcId(Frozen):
    __slots__ = ("boot_id", "pid", "start_ticks")
    boot_id: str
    pid: int
    start_ticks: int

    def __init__(self, boot_id: str, pid: int, start_ticks: int) -> None:
        self._init(boot_id=boot_id, pid=pid, start_ticks=start_ticks)

    @classmethod
    def of(cls, pid: int) -> ProcId | None:
        ticks = start_ticks(pid)
        return None if ticks is None else cls(boot_id(), pid, ticks)

    @classmethod
    def from_dict(cls, d: Any) -> ProcId:
        if not isinstance(d, dict):
            raise ValueError("process identity must be a map")
        b, p, t = d.get("boot_id"), d.get("pid"), d.get("start_ticks")
        if not isinstance(b, str) or not isinstance(p, int) or not isinstance(t, int) or p <= 0:
            raise ValueError("process identity needs boot_id (str), pid and start_ticks (int)")
        return cls(b, p, t)

    def to_dict(self) -> dict[str, Any]:
        return {"boot_id": self.boot_id, "pid": self.pid, "start_ticks": self.start_ticks}

    def alive(self) -> bool:
        """True when this very process (not a successor with its pid) still runs."""
        if self.boot_id != boot_id():
            return False
        st = proc_stat(self.pid)
        return st is not None and not st.dead and st.start_ticks == self.start_ticks


def all_processes() -> Iterator[ProcStat]:
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None:
                yield st


def children(pid: int) -> list[int] | None:
    """The direct children of ``pid`` (of every one of its threads: a child belongs to the
    thread that forked it, an orphan to the first live thread of its new parent), read from
    ``/proc/PID/task/TID/children``: O(threads + children) where ``all_processes`` reads every
    process on the machine. None where the kernel has no such file (CONFIG_PROC_CHILDREN), or
    ``pid`` is gone.

    Not a snapshot: the kernel resumes a read longer than a page (~500 children) by position,
    so a child reaped meanwhile can make it skip one. Callers that need every child reap on the
    same thread, or look again after a reap (``supervisor/sweeper.py``).
    """
    task = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task)
    except OSError:
        return None
    found: list[int] | None = None
    for tid in tids:
        try:
            fd = os.open(f"{task}/{tid}/children", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # no such file on this kernel, or the thread just ended
            continue
        try:
            data = b""
            while chunk := os.read(fd, 65536):
                data += chunk
        except OSError:
            continue
        finally:
            os.close(fd)
        found = (found or []) + [int(p) for p in data.split()]
    return found
