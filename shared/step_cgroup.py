"""One step's cgroup (I/O): ``StepCgroup``, for the supervisor that owns it and for the agent
once that supervisor is gone; ``remove_tree`` (every step cgroup under a directory) for the
agent's orphans; and the cgroupfs file helpers they are built on. Apart from
``shared/cgroup_host.py`` (the agent's probe, once at start), which a supervisor never runs;
modes, layout and plans, which are pure, are in ``shared/cgroup_layout.py``.

The supervisor creates the step's directories before the first fork and puts each task in them
before it execs by joining them itself around the fork (``joined``): Popen has no way to place a
child, and after exec a task could fork before being moved. The supervisor leaves again at
once, so it is outside when an OOM victim is chosen (charges it made meanwhile stay where they
were made).

Every write goes through ``os.write`` so that cgroupfs errors surface (a buffered write would
report them at close, where they are easy to lose).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

from tether.shared.cgroup_layout import UNIFIED, V1_KINDS, Mount, parse_mountinfo, parse_proc_cgroup
from tether.shared.cgroup_layout import join as _join

#: how long a freeze may take to settle before the kill goes on regardless
FREEZE_TIMEOUT = 1.0
#: kill passes over the remaining pids (each catches what forked during the last)
KILL_PASSES = 20


class CgroupError(Exception):
    pass


# ---- file helpers ------------------------------------------------------------------------------


def write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read(path: str) -> str:
    """A whole cgroupfs (or /proc) file: plain reads, none of a file object's probing."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
    finally:
        os.close(fd)
    return data.decode()


def read_keyed(path: str) -> dict[str, int]:
    """A flat-keyed file (``memory.events``, ``memory.oom_control``, ``cpu.stat``)."""
    out = {}
    with contextlib.suppress(OSError):
        for line in read(path).splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                out[parts[0]] = int(parts[1])
    return out


def _read_int(path: str) -> int | None:
    try:
        text = read(path).strip()
    except OSError:
        return None
    return int(text) if text.lstrip("-").isdigit() else None


def procs_of(path: str) -> set[int]:
    try:
        return {int(p) for p in read(os.path.join(path, "cgroup.procs")).split()}
    except FileNotFoundError:
        return set()


# ---- one step's cgroup ---------------------------------------------------------------------


class StepCgroup:
    """The step's directories (one per hierarchy) and what can be done with them."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.mode = str(plan.get("mode", "none"))
        self.dirs: dict[str, str] = dict(plan.get("dirs", {})) if self.mode != "none" else {}
        self.memory_mb = int(plan.get("memory_mb", 0))
        #: kind -> the hierarchy's mount point, as the agent's probe found it (a spec of an
        #: older agent has none: the mount table says)
        self.roots: dict[str, str] = dict(plan.get("roots", {}))
        #: where this process was before joining (kind -> its own cgroup's directory)
        self._home: dict[str, str] = {}

    @property
    def active(self) -> bool:
        return bool(self.dirs)

    def exists(self) -> bool:
        return any(os.path.isdir(d) for d in self.dirs.values())

    def create(self) -> None:
        """The directories and the memory limit (no swap beyond it). Raises CgroupError."""
        try:
            for kind, path in self.dirs.items():
                # the agent's base too: an agent that stopped for good removes its empty base,
                # and a step it had already claimed may start just after
                os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o755)
                if kind == "memory" and self.memory_mb:
                    limit = str(self.memory_mb << 20)
                    write(os.path.join(path, "memory.limit_in_bytes"), limit)
                    memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
                    if os.path.exists(memsw):
                        write(memsw, limit)
                elif kind == UNIFIED and self.memory_mb and os.path.exists(
                        os.path.join(path, "memory.max")):
                    write(os.path.join(path, "memory.max"), str(self.memory_mb << 20))
                    swap = os.path.join(path, "memory.swap.max")
                    if os.path.exists(swap):
                        write(swap, "0")
        except OSError as exc:
            raise CgroupError(f"cannot create the step's cgroup: {exc}") from None

    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        """This process (every thread) inside the step's cgroups for the duration: a child
        forked meanwhile starts there. Back home after, whatever happens."""
        if not self._home:
            mine = parse_proc_cgroup(read("/proc/self/cgroup"))
            for kind in self.dirs:
                root = self.roots.get(kind) or _mount_root(kind)
                self._home[kind] = _join(root, mine.get(kind, "/"))
        pid = str(os.getpid())
        entered = []
        try:
            for kind, path in self.dirs.items():
                try:
                    write(os.path.join(path, "cgroup.procs"), pid)
                except OSError as exc:
                    raise CgroupError(f"cannot enter the step's cgroup {path}: {exc}") \
                        from None
                entered.append(kind)
            yield
        finally:
            for kind in entered:
                try:
                    write(os.path.join(self._home[kind], "cgroup.procs"), pid)
                except OSError:  # never stay inside: the home's parent takes us
                    write(os.path.join(os.path.dirname(self._home[kind]), "cgroup.procs"),
                          pid)

    def procs(self) -> set[int]:
        pids: set[int] = set()
        for path in self.dirs.values():
            pids |= procs_of(path)
        return pids

    def empty(self) -> bool:
        return not self.procs()

    def signal_all(self, sig: int) -> int:
        n = 0
        for pid in self.procs():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                n += 1
        return n

    def _freezer(self) -> tuple[str, str, str] | None:
        """(file, frozen value, thawed value) of the freezer, if any."""
        if "freezer" in self.dirs:
            return (os.path.join(self.dirs["freezer"], "freezer.state"), "FROZEN", "THAWED")
        if UNIFIED in self.dirs and os.path.exists(os.path.join(self.dirs[UNIFIED],
                                                                "cgroup.freeze")):
            return (os.path.join(self.dirs[UNIFIED], "cgroup.freeze"), "1", "0")
        return None

    @property
    def can_freeze(self) -> bool:
        return self._freezer() is not None

    def freeze(self, wait: float = FREEZE_TIMEOUT) -> bool:
        """Freeze the step; True once the kernel says it is frozen (within ``wait``)."""
        fz = self._freezer()
        if fz is None:
            raise CgroupError("this step's cgroup has no freezer")
        try:
            write(fz[0], fz[1])
        except OSError as exc:
            raise CgroupError(f"cannot freeze the step: {exc}") from None
        deadline = time.monotonic() + wait
        while not self.frozen():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def thaw(self) -> None:
        fz = self._freezer()
        if fz is None:
            return
        try:
            write(fz[0], fz[2])
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise CgroupError(f"cannot thaw the step: {exc}") from None

    def frozen(self) -> bool:
        if "freezer" in self.dirs:
            try:
                return read(os.path.join(self.dirs["freezer"], "freezer.state")).strip() \
                    == "FROZEN"
            except OSError:
                return False
        if UNIFIED in self.dirs:
            return read_keyed(os.path.join(self.dirs[UNIFIED], "cgroup.events")).get(
                "frozen") == 1
        return False

    def kill(self) -> None:
        """SIGKILL every process of the step: v2 ``cgroup.kill``; otherwise freeze (nothing can
        fork meanwhile), kill every pid, thaw (the kills land). Does not wait: see ``empty``."""
        unified = self.dirs.get(UNIFIED)
        if unified and os.path.exists(os.path.join(unified, "cgroup.kill")):
            try:
                write(os.path.join(unified, "cgroup.kill"), "1")
                return
            except FileNotFoundError:
                return
            except OSError:
                pass  # fall back to the pid by pid kill below
        fz = self._freezer()
        frozen = False
        if fz is not None:
            with contextlib.suppress(CgroupError):
                frozen = self.freeze()
        try:
            for _ in range(1 if frozen else KILL_PASSES):
                if not self.signal_all(signal.SIGKILL):
                    break
        finally:
            if fz is not None:
                with contextlib.suppress(CgroupError):
                    self.thaw()

    def kill_and_wait(self, timeout: float = 2.0) -> bool:
        """Kill, then wait (bounded) until no process is left. True if empty."""
        deadline = time.monotonic() + timeout
        while True:
            if self.empty():
                return True
            self.kill()
            if time.monotonic() > deadline:
                return self.empty()
            time.sleep(0.001)

    def remove(self) -> bool:
        """rmdir every directory; True when none is left. Never raises."""
        ok = True
        for path in self.dirs.values():
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    ok = False
        return ok

    def oom_kills(self) -> int:
        """How many processes the OOM killer took in this cgroup (0 where not counted)."""
        if "memory" in self.dirs:
            return read_keyed(os.path.join(self.dirs["memory"], "memory.oom_control")).get(
                "oom_kill", 0)
        if UNIFIED in self.dirs:
            return read_keyed(os.path.join(self.dirs[UNIFIED], "memory.events")).get(
                "oom_kill", 0)
        return 0

    def usage(self) -> dict[str, float | int | None]:
        """What the step used in all, as its cgroup counted it (read at its end, before the
        directories go): CPU seconds in user and system mode (every process of the step, an
        unwaited daemon's too) and the memory peak in bytes (page cache included: what its
        memory limit is enforced against); None where this host does not count it (cgroup v2
        before Linux 5.19 has no ``memory.peak``)."""
        user = system = peak = None
        if "memory" in self.dirs:
            peak = _read_int(os.path.join(self.dirs["memory"], "memory.max_usage_in_bytes"))
        elif UNIFIED in self.dirs:
            peak = _read_int(os.path.join(self.dirs[UNIFIED], "memory.peak"))
        if "cpuacct" in self.dirs:
            d = self.dirs["cpuacct"]
            u_ns = _read_int(os.path.join(d, "cpuacct.usage_user"))
            s_ns = _read_int(os.path.join(d, "cpuacct.usage_sys"))
            if u_ns is not None and s_ns is not None:
                user, system = u_ns / 1e9, s_ns / 1e9
            else:  # older kernels: clock ticks
                ticks = read_keyed(os.path.join(d, "cpuacct.stat"))
                hz = os.sysconf("SC_CLK_TCK")
                if "user" in ticks and "system" in ticks:
                    user, system = ticks["user"] / hz, ticks["system"] / hz
        elif UNIFIED in self.dirs:
            stat = read_keyed(os.path.join(self.dirs[UNIFIED], "cpu.stat"))
            if "user_usec" in stat and "system_usec" in stat:
                user, system = stat["user_usec"] / 1e6, stat["system_usec"] / 1e6
        return {"cpu_user": user, "cpu_system": system, "memory_peak": peak}

    def stats(self) -> dict[str, Any]:
        """Memory current and peak (bytes), CPU seconds and pids, from the kernel's counters;
        None where this host does not count it."""
        mem_cur = mem_peak = cpu = None
        if "memory" in self.dirs:
            d = self.dirs["memory"]
            mem_cur = _read_int(os.path.join(d, "memory.usage_in_bytes"))
            mem_peak = _read_int(os.path.join(d, "memory.max_usage_in_bytes"))
        elif UNIFIED in self.dirs:
            d = self.dirs[UNIFIED]
            mem_cur = _read_int(os.path.join(d, "memory.current"))
            mem_peak = _read_int(os.path.join(d, "memory.peak"))
        if "cpuacct" in self.dirs:
            ns = _read_int(os.path.join(self.dirs["cpuacct"], "cpuacct.usage"))
            cpu = None if ns is None else round(ns / 1e9, 3)
        elif UNIFIED in self.dirs:
            usec = read_keyed(os.path.join(self.dirs[UNIFIED], "cpu.stat")).get("usage_usec")
            cpu = None if usec is None else round(usec / 1e6, 3)
        return {"mode": self.mode, "memory_current": mem_cur, "memory_peak": mem_peak,
                "memory_limit_mb": self.memory_mb or None, "cpu_seconds": cpu,
                "pids": len(self.procs()), "frozen": self.frozen()}


def _mount_root(kind: str) -> str:
    """The mount point of ``kind``'s hierarchy, from the mount table (cached)."""
    global _MOUNTS
    if _MOUNTS is None:
        with open("/proc/self/mountinfo") as f:
            _MOUNTS = parse_mountinfo(f.read())
    for m in _MOUNTS:
        if (kind == UNIFIED and m.fstype == "cgroup2") or (
                m.fstype == "cgroup" and kind in m.controllers):
            return m.point
    raise CgroupError(f"no mount for the {kind} hierarchy")


_MOUNTS: list[Mount] | None = None


def remove_tree(top: str, patience: float = 10.0) -> bool:
    """Kill everything under ``top`` (a directory in one hierarchy) and remove it, deepest first.
    For the tests', benchmarks' and demo's clean-up after their agents. A killed process may
    take more than a moment to leave its cgroup (a loaded machine, a step still forking): each
    directory is killed and removed again until it is gone or ``patience`` seconds passed. True
    when it is gone."""
    if not os.path.isdir(top):
        return True
    deadline = time.monotonic() + patience
    for dirpath, dirnames, _ in os.walk(top, topdown=False):
        for d in dirnames:
            _kill_dir(os.path.join(dirpath, d), deadline)
    _kill_dir(top, deadline)
    return not os.path.isdir(top)


def _kill_dir(path: str, deadline: float) -> None:
    cg = StepCgroup({"mode": "x", "dirs": {_kind_of(path): path}})
    while True:
        cg.kill_and_wait(min(1.0, max(0.0, deadline - time.monotonic())))
        if cg.remove() or time.monotonic() > deadline:
            return
        time.sleep(0.02)


def _kind_of(path: str) -> str:
    global _MOUNTS
    if _MOUNTS is None:
        with open("/proc/self/mountinfo") as f:
            _MOUNTS = parse_mountinfo(f.read())
    best: Mount | None = None
    for m in _MOUNTS:
        if (path + "/").startswith(m.point.rstrip("/") + "/") and (
                best is None or len(m.point) > len(best.point)):
            best = m
    if best is None:
        return "none"
    if best.fstype == "cgroup2":
        return UNIFIED
    for kind in (*V1_KINDS, "cpuset"):
        if kind in best.controllers:
            return kind
    return "other"
