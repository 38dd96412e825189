"""What the introspection verbs read: /proc, the output files. Parsers and planners are pure.

Who belongs to the step. The supervisor is a child subreaper and every task is its direct child,
so a process of the step is one whose parent chain leads to the supervisor: a task leader, a
descendant of one, or a daemon that left its task (double fork, ``setsid``) and was re-parented
to the supervisor. Members of the supervisor's session that are not its descendants (nothing
should be) are counted too, its own ancestors excepted. A process belongs to the task whose
leader its chain passes through; the rest are *adopted*, of no task.

Where to look (``step_snapshot``). Where the kernel has ``/proc/PID/task/TID/children`` the
step's processes are found from the supervisor down through those files, whatever else runs on
the machine; elsewhere (and with the ``proc-scan`` test fault) by reading every process in
/proc. Both find the same processes: the session is the supervisor's own (forked from the
template, it leads it) or was made by a process that exited right after forking the supervisor
(the detaching shell of a cold start), so every other member descends from the supervisor
(orphans come back to it), its ancestors excepted.

CPU and memory. For a live task: the sum over its live processes of their own user and system
time plus their reaped children's (``cutime``/``cstime``: every process that was waited for is
counted once, by its reaper), the sum of their ``VmRSS`` (current) and the sum of their
``VmHWM`` (peak: each process's own high-water mark, so an upper bound of the group's peak while
these processes live). Once the leader is reaped: its ``wait4`` rusage, which covers the same
CPU time; its ``ru_maxrss`` is the largest peak of any one process of the task that was waited
for. Times are seconds; memory is KiB.

Output. Always read through the fds opened at launch (``Launcher.readers``) with ``pread``; the
paths are never reopened, since the job's user may have replaced them with links to anything.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from tether.shared.procid import CLK_TCK, children

PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024

#: At most this many bytes per stream in one ``output --lines`` reply (two streams stay well
#: under the 1 MiB frame limit).
TAIL_MAX = 256 * 1024
#: At most this many bytes per stream in one follow reply.
FOLLOW_MAX = 64 * 1024
#: At most this many extra processes in a ``pids`` reply (about 150 bytes each).
MAX_PROCESSES = 2048


# ---- /proc/PID/stat and /proc/PID/status ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcSample:
    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    utime: int  # clock ticks
    stime: int
    cutime: int
    cstime: int
    start_ticks: int
    rss_kb: int = 0
    hwm_kb: int = 0

    @property
    def dead(self) -> bool:
        return self.state in ("Z", "X", "x")

    @property
    def cpu_user(self) -> float:
        return (self.utime + self.cutime) / CLK_TCK

    @property
    def cpu_system(self) -> float:
        return (self.stime + self.cstime) / CLK_TCK


def parse_stat(pid: int, raw: bytes) -> ProcSample | None:
    """One /proc/PID/stat line; None if it does not parse. ``comm`` may hold spaces and ')'."""
    lpar, rpar = raw.find(b"("), raw.rfind(b")")
    if lpar < 0 or rpar < lpar:
        return None
    comm = raw[lpar + 1:rpar].decode(errors="replace")
    rest = raw[rpar + 2:].split()
    try:
        return ProcSample(
            pid=pid, comm=comm, state=rest[0].decode(), ppid=int(rest[1]), pgrp=int(rest[2]),
            session=int(rest[3]), utime=int(rest[11]), stime=int(rest[12]),
            cutime=int(rest[13]), cstime=int(rest[14]), start_ticks=int(rest[19]),
            rss_kb=max(0, int(rest[21])) * PAGE_KB,
        )
    except (IndexError, ValueError):
        return None


def parse_status_memory(text: str) -> tuple[int | None, int | None]:
    """(VmRSS, VmHWM) in KiB from /proc/PID/status; None where absent (kernel threads, zombies)."""
    rss = hwm = None
    for line in text.splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            parts = line.split()
            try:
                value = int(parts[1])
            except (IndexError, ValueError):
                continue
            if line.startswith("VmRSS:"):
                rss = value
            else:
                hwm = value
    return rss, hwm


def sample(pid: int) -> ProcSample | None:
    """Read one process's stat (I/O); None if it is gone or hidden from us."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return parse_stat(pid, f.read())
    except OSError:
        return None


def with_memory(st: ProcSample) -> ProcSample:
    """The same sample with VmRSS and VmHWM from /proc/PID/status (I/O), where readable."""
    try:
        with open(f"/proc/{st.pid}/status") as f:
            rss, hwm = parse_status_memory(f.read())
    except OSError:
        return st
    return replace(st, rss_kb=st.rss_kb if rss is None else rss,
                   hwm_kb=0 if hwm is None else hwm)


def scan() -> list[ProcSample]:
    """Every process in /proc (I/O)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = sample(int(name))
            if st is not None:
                found.append(st)
    return found


def snapshot(supervisor: int, session: int) -> list[ProcSample]:
    """``scan()``, with memory read for every process that may be the step's (in its session,
    or the supervisor's child): all the I/O ``pids`` and ``stats`` need, done at once, on the
    supervisor's scan thread (``sweeper.Scan``)."""
    return [with_memory(p) if p.session == session or p.ppid == supervisor else p
            for p in scan()]


def descendants(supervisor: int, session: int) -> list[ProcSample] | None:
    """The supervisor's descendants, from its children files down (I/O, O(the step)); memory
    read as ``snapshot`` reads it. None where the kernel has no children files."""
    queue = children(supervisor)
    if queue is None:
        return None
    seen = {supervisor}
    found = []
    while queue:
        pid = queue.pop()
        if pid in seen:
            continue
        seen.add(pid)
        st = sample(pid)
        if st is None:  # gone meanwhile: its children were re-parented to the supervisor
            continue
        found.append(with_memory(st) if st.session == session or st.ppid == supervisor
                     else st)
        queue += children(pid) or []
    return found


def step_snapshot(supervisor: int, session: int, *, full: bool = False) -> list[ProcSample]:
    """What ``pids`` and ``stats`` need (module docstring: where to look); ``full``: every
    process in /proc, as where the kernel has no children files."""
    found = None if full else descendants(supervisor, session)
    return snapshot(supervisor, session) if found is None else found


# ---- the step's processes (pure) ---------------------------------------------------------------


@dataclass
class StepProcesses:
    """The step's live processes, split by task. ``by_rank`` includes each task's leader."""

    by_rank: dict[int, list[ProcSample]] = field(default_factory=dict)
    adopted: list[ProcSample] = field(default_factory=list)
    #: every member's pid -> its rank, or None for an adopted process
    owner: dict[int, int | None] = field(default_factory=dict)


def step_processes(procs: Iterable[ProcSample], supervisor: int, session: int,
                   leaders: dict[int, int]) -> StepProcesses:
    """Split ``procs`` into the step's processes by task.

    ``leaders`` maps each live task leader's pid to its rank. Dead (zombie) processes are left
    out. The supervisor and its ancestors are never counted.
    """
    table = {p.pid: p for p in procs}
    ancestors = set()
    pid = supervisor
    while pid > 1 and pid not in ancestors:
        ancestors.add(pid)
        parent = table.get(pid)
        pid = parent.ppid if parent is not None else 0

    memo: dict[int, tuple[bool, int | None]] = {}

    def classify(pid: int) -> tuple[bool, int | None]:
        """(is of the step, rank or None), following parents iteratively."""
        chain = []
        result: tuple[bool, int | None] = (False, None)
        seen = set()
        while True:
            if pid in memo:
                result = memo[pid]
                break
            if pid in leaders:
                result = (True, leaders[pid])
                break
            p = table.get(pid)
            if p is None or pid <= 1 or pid in seen:
                result = (False, None)
                break
            if p.ppid == supervisor:
                result = (True, None)
                chain.append(pid)
                break
            seen.add(pid)
            chain.append(pid)
            pid = p.ppid
        for c in chain:
            memo[c] = result
        return result

    out = StepProcesses(by_rank={rank: [] for rank in leaders.values()})
    for p in table.values():
        if p.dead or p.pid == supervisor or p.pid in ancestors:
            continue
        member, rank = classify(p.pid)
        if not member and not (session > 0 and p.session == session):
            continue
        out.owner[p.pid] = rank
        if rank is None:
            out.adopted.append(p)
        else:
            out.by_rank[rank].append(p)
    for group in out.by_rank.values():
        group.sort(key=lambda p: p.pid)
    out.adopted.sort(key=lambda p: p.pid)
    return out


def usage(procs: Iterable[ProcSample]) -> dict[str, float | int]:
    """CPU seconds, RSS and peak RSS summed over a group of live processes (pure)."""
    user = system = 0.0
    rss = peak = 0
    for p in procs:
        user += p.cpu_user
        system += p.cpu_system
        rss += p.rss_kb
        peak += max(p.hwm_kb, p.rss_kb)
    return {"cpu_user": round(user, 3), "cpu_system": round(system, 3), "rss_kb": rss,
            "peak_rss_kb": peak}


def elapsed(start_ticks: int, end_boottime: float | None, now_boottime: float) -> float:
    """Seconds from a process's start (ticks since boot) to its end, or to now (pure)."""
    if start_ticks <= 0:
        return 0.0
    end = now_boottime if end_boottime is None else end_boottime
    return round(max(0.0, end - start_ticks / CLK_TCK), 3)


_user_names: dict[int, str | None] = {}


def user_name(uid: int) -> str | None:
    """The name of ``uid``, looked up once (NSS may be slow; the loop must not wait twice)."""
    if uid not in _user_names:
        try:
            _user_names[uid] = pwd.getpwuid(uid).pw_name
        except (KeyError, OverflowError):
            _user_names[uid] = None
    return _user_names[uid]


# ---- output files --------------------------------------------------------------------------

Reader = Callable[[int, int], bytes]  # (offset, length) -> bytes


def fd_reader(fd: int) -> Reader:
    def read(offset: int, length: int) -> bytes:
        return os.pread(fd, length, offset)
    return read


def fd_size(fd: int) -> int:
    return os.fstat(fd).st_size


def tail_start(read: Reader, size: int, lines: int, cap: int = TAIL_MAX,
               chunk: int = 8192) -> tuple[int, bool]:
    """Where the last ``lines`` lines of a ``size``-byte file start: (offset, truncated).

    A final line without a newline counts as a line; the newline that ends the file does not
    start another. When the lines span more than ``cap`` bytes, the last ``cap`` bytes are
    chosen and ``truncated`` is true.
    """
    if lines <= 0 or size <= 0:
        return size, False
    floor = max(0, size - cap)
    end = size
    # the file's last byte, if a newline, ends the last line rather than separating two
    need = lines + 1 if read(size - 1, 1) == b"\n" else lines
    while end > floor:
        start = max(floor, end - chunk)
        data = read(start, end - start)
        if len(data) < end - start:  # shrank under us: take what is there
            return start, False
        pos = len(data)
        while True:
            pos = data.rfind(b"\n", 0, pos)
            if pos < 0:
                break
            need -= 1
            if need == 0:
                return start + pos + 1, False
        end = start
    return floor, floor > 0


def read_span(read: Reader, offset: int, end: int, limit: int) -> bytes:
    """Bytes [offset, min(end, offset+limit)), read in as many preads as it takes."""
    want = max(0, min(end, offset + limit) - offset)
    parts = []
    while want > 0:
        data = read(offset, want)
        if not data:
            break
        parts.append(data)
        offset += len(data)
        want -= len(data)
    return b"".join(parts)
