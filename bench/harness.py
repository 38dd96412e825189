"""What every benchmark part shares: statistics, /proc readers, an agent on a scratch state
directory, and a cleaner that kills everything a run started (also on errors and signals)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tether.shared import stamps
from tether.shared.client import Client, probe_unix
from tether.shared.errors import TetherError
from tether.shared.paths import Layout

T = TypeVar("T")

SERVING_RE = re.compile(r"agent serving on \S+ after (\d+) ms")
REATTACH_RE = re.compile(r"reattach: (\d+) active job\(s\), (\d+) to probe")
MY_PID = os.getpid()


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class BenchError(Exception):
    pass


# ---- small helpers ----------------------------------------------------------------------------


def poll_until(predicate: Callable[[], T], timeout: float, what: str,
               interval: float = 0.02) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def rfc3339_epoch(text: str) -> float:
    value = stamps.epoch(text)
    assert value is not None, f"not an RFC 3339 stamp: {text!r}"
    return value


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, 'inclusive')."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: list[float], digits: int = 1) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "median": round(statistics.median(values), digits),
        "p90": round(percentile(values, 0.9), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "mean": round(statistics.fmean(values), digits),
    }


def proc_fields(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, session, start ticks) from /proc/PID/stat, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw[raw.rfind(b")") + 2:].split()
    try:
        return rest[0].decode(), int(rest[1]), int(rest[3]), int(rest[19])
    except (IndexError, ValueError):
        return None


def alive(pid: int, ticks: int | None = None) -> bool:
    st = proc_fields(pid)
    if st is None or st[0] in ("Z", "X", "x"):
        return False
    return ticks is None or st[3] == ticks


def all_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def touches(pid: int, root: bytes) -> bool:
    """Does this process name ``root`` in its argv, its cwd or any open file?

    The argv alone is not enough: supervisors call setproctitle, which overwrites their
    /proc/PID/cmdline with "tether-supervisor job=N attempt=M" (the --run-dir is gone). Their
    open fds (run-directory lock, supervisors.log) and their tasks' (output files) still
    name the state directory.
    """
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if root in f.read():
                return True
    except OSError:
        return False
    with contextlib.suppress(OSError):
        if os.readlink(f"/proc/{pid}/cwd").encode().startswith(root):
            return True
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").encode().startswith(root):
                return True
    return False


def descendants_of_me() -> set[int]:
    """Every live process whose parent chain reaches this one (we are a child subreaper)."""
    parent: dict[int, int] = {}
    for pid in all_pids():
        st = proc_fields(pid)
        if st is not None:
            parent[pid] = st[1]
    out = set()
    for pid in parent:
        seen = 0
        p = pid
        while p in parent and seen < 64:
            p = parent[p]
            seen += 1
            if p == MY_PID:
                out.add(pid)
                break
    return out


def mem_of(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, Pss, Pss_Anon (kB), threads and open fds of one process."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "Threads"):
                out[key] = int(rest.split()[0])
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Pss", "Pss_Anon", "Pss_File", "Private_Dirty"):
                out[key] = int(rest.split()[0])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def cpu_load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def foreign_tether_processes(root: bytes) -> int:
    """Tether agents/supervisors on this machine that are not ours (concurrent work)."""
    n = 0
    for pid in all_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        ours = root in cmd or touches(pid, root)
        if (cmd.startswith(b"tether-supervisor") or b"tether.cli.main\0agent" in cmd
                or b"tether\0agent" in cmd) and alive(pid) and not ours:
            n += 1
    return n


# ---- one agent on one state directory ---------------------------------------------------------


class Agent:
    def __init__(self, root: str, name: str, cpus: int, extra: tuple[str, ...] = ()) -> None:
        #: more agent options (``--ksm``)
        self.extra = extra
        self.dir = os.path.join(root, name)
        self.state = os.path.join(self.dir, "s")
        self.work = os.path.join(self.dir, "w")
        os.makedirs(self.work)
        self.layout = Layout(self.state)
        self.cpus = cpus
        self.proc: subprocess.Popen[bytes] | None = None
        self.logs: list[str] = []
        self.client: Client | None = None

    @property
    def sock(self) -> str:
        return self.layout.sock

    def start(self) -> float:
        """Start the agent; return the perf_counter() taken just before Popen."""
        assert self.proc is None or self.proc.poll() is not None
        self.close_client()
        path = os.path.join(self.dir, f"agent{len(self.logs)}.log")
        self.logs.append(path)
        with open(path, "wb") as out:
            t0 = time.perf_counter()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tether.cli.main", "agent", "--state-dir", self.state,
                 "--cpus", str(self.cpus), "--oversubscribe", "--cancel-grace", "1",
                 *self.extra],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.work, start_new_session=True,
            )
        return t0

    def wait_serving(self, t0: float, timeout: float = 30.0,
                     interval: float = 0.005) -> float:
        """Poll until ``status`` answers; return seconds since ``t0``."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise BenchError(f"agent exited with {self.proc.returncode}:\n{self.tail()}")
            if probe_unix(self.sock, timeout=0.5) is None:
                try:
                    with Client(self.sock, timeout=2.0) as c:
                        c.call("status")
                    return time.perf_counter() - t0
                except TetherError:
                    pass
            if time.monotonic() > deadline:
                raise BenchError(f"agent did not answer within {timeout:g}s:\n{self.tail()}")
            time.sleep(interval)

    def serving_ms(self) -> int | None:
        with open(self.logs[-1], errors="replace") as f:
            m = SERVING_RE.search(f.read())
        return int(m.group(1)) if m else None

    def log_text(self) -> str:
        with open(self.logs[-1], errors="replace") as f:
            return f.read()

    def tail(self) -> str:
        try:
            return self.log_text()[-3000:]
        except OSError:
            return "(no log)"

    def call(self, kind: str, args: dict[str, Any] | None = None,
             timeout: float = 10.0) -> Any:
        if self.client is None:
            self.client = Client(self.sock, timeout=timeout)
        return self.client.call(kind, args or {}, timeout=timeout)

    def close_client(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def submit(self, command: list[str]) -> int:
        job = self.call("submit", {"command": command, "workdir": self.work,
                                   "env": dict(os.environ)})
        return int(job["id"])

    def kill(self) -> None:
        self.close_client()
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(timeout=10)


# ---- CPU of everything a run starts ------------------------------------------------------------


class CpuAccount:
    """A fresh cgroup of the v1 ``cpuacct`` hierarchy that this process (and so everything it
    starts from now on: agent, template, supervisors, tasks) is moved into: ``cpuacct.usage``
    then counts the CPU of all of them. Steps' cgroups never touch that hierarchy (tether uses
    memory, pids, freezer, cpuacct only in mode ``v1``; this figure is taken in the others).
    None of it where there is no such hierarchy (``usage`` is None)."""

    MOUNT = "/sys/fs/cgroup/cpuacct"

    def __init__(self, name: str) -> None:
        self.path: str | None = None
        self.home: str | None = None
        if not os.path.exists(os.path.join(self.MOUNT, "cpuacct.usage")):
            return
        try:
            with open("/proc/self/cgroup") as f:
                for line in f:
                    _, ctrl, rel = line.rstrip("\n").split(":", 2)
                    if "cpuacct" in ctrl.split(","):
                        self.home = os.path.join(self.MOUNT, rel.lstrip("/"))
            path = os.path.join(self.MOUNT, f"{name}-{os.getpid()}")
            os.mkdir(path)
            self.path = path
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError as exc:
            log(f"no CPU account: {exc}")
            self.close()

    def usage(self) -> float | None:
        """CPU seconds of everything in the account so far."""
        if self.path is None:
            return None
        with open(os.path.join(self.path, "cpuacct.usage")) as f:
            return int(f.read()) / 1e9

    def leave(self) -> None:
        """This process goes home; what it started stays (and is counted) until it ends."""
        if self.path is not None and self.home is not None:
            with contextlib.suppress(OSError), \
                    open(os.path.join(self.home, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    def close(self) -> None:
        """Once everything it held was killed (``Cleaner.run``): removed when empty."""
        self.leave()
        path, self.path = self.path, None
        deadline = time.monotonic() + 5
        while path is not None:
            try:
                os.rmdir(path)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    log(f"WARNING: cannot remove {path}: {exc}")
                    return
                time.sleep(0.02)


# ---- cleanup ----------------------------------------------------------------------------------


class Cleaner:
    """Kills everything this run started: agents, supervisors, their sessions; reaps them."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.root_b = root.encode()
        self.agents: list[Agent] = []
        self.accounts: list[CpuAccount] = []

    def victims(self) -> set[int]:
        found = set()
        sessions = set()
        mine = descendants_of_me()
        for pid in all_pids():
            if pid == MY_PID:
                continue
            st = proc_fields(pid)
            if st is None or st[0] in ("Z", "X", "x"):
                continue
            if pid in mine or touches(pid, self.root_b):
                found.add(pid)
                sessions.add(st[2])
        sessions.discard(os.getsid(0))
        for pid in all_pids():
            st = proc_fields(pid)
            if pid != MY_PID and st is not None and st[2] in sessions and st[0] not in "ZXx":
                found.add(pid)
        return found

    def run(self) -> set[int]:
        for a in self.agents:
            with contextlib.suppress(Exception):
                a.kill()
        killed: set[int] = set()
        for _ in range(20):
            pids = self.victims()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
            time.sleep(0.05)
            reap_zombie_children()
        else:
            log(f"WARNING: could not get rid of {sorted(self.victims())}")
        reap_zombie_children()
        from bench.common import remove_cgroups_under

        remove_cgroups_under(self.root)
        for acct in self.accounts:
            acct.close()
        shutil.rmtree(self.root, ignore_errors=True)
        return killed


def reap_zombie_children() -> int:
    """Reap zombies re-parented to us (orphaned supervisors and jobs); never a Popen's child."""
    n = 0
    for pid in all_pids():
        st = proc_fields(pid)
        if st is not None and st[1] == MY_PID and st[0] == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
                n += 1
    return n


def become_subreaper() -> bool:
    """Orphans (the detached supervisors and their jobs) get re-parented to us, not to init:
    we can find them by ancestry and reap them, in a container whose init does not."""
    try:
        import prctl
        prctl.set_child_subreaper(1)
        return True
    except Exception:  # noqa: BLE001  (optional: python-prctl missing or refused)
        return False
