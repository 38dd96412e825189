"""Benchmarks for tether: job latency, agent restart with live jobs, supervisor footprint.

Run from the repository root:

    .venv/bin/python bench/bench.py            # readable report on stdout
    .venv/bin/python bench/bench.py --json     # one JSON object on stdout

Progress goes to stderr. Every agent runs on its own short state directory under a fresh
``tempfile.mkdtemp(dir="/tmp")``; everything the benchmark started (agents, supervisors, their
jobs) is killed and the directory removed on the way out, also on an error or a signal.

What is measured (see bench/README.md for figures):

1. latency of ``true``, in-process with ``shared.client.Client``:
   - submit -> running: the job's ``started_at`` (stamped by its supervisor just before it
     forks the task, millisecond resolution) minus the wall-clock time just before the
     ``submit`` request was sent;
   - submit -> completed: from just before ``submit`` to the reply of a long-polling ``wait``
     saying the job is done;
   - submit -> visible: a separate series polling ``show`` every few ms, until the agent itself
     reports the job ``running`` (or already ended);
   - end-to-end ``tether submit --wait -- true`` wall time via the installed CLI.
2. time from agent start (Popen) to ``status`` answering with 50 live jobs, after SIGKILL of the
   previous agent, plus the agent's own "serving ... after N ms" figure; every job must survive.
3. RSS / PSS / threads / fds of an idle supervisor (one ``sleep 60`` job at a time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

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
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


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
    def __init__(self, root: str, name: str, cpus: int) -> None:
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
                 "--cpus", str(self.cpus), "--cancel-grace", "1"],
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


# ---- cleanup ----------------------------------------------------------------------------------


class Cleaner:
    """Kills everything this run started: agents, supervisors, their sessions; reaps them."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.root_b = root.encode()
        self.agents: list[Agent] = []

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


# ---- 1. latency -------------------------------------------------------------------------------


def bench_latency(agent: Agent, samples: int, warmup: int, visible_samples: int,
                  cli_samples: int) -> dict[str, Any]:
    def one() -> tuple[float, float, float, dict[str, Any]]:
        wall = time.time()
        t0 = time.perf_counter()
        job = agent.call("submit", {"command": ["true"], "workdir": agent.work,
                                    "env": dict(os.environ)})
        t_ack = time.perf_counter()
        res = agent.call("wait", {"job": job["id"], "hold": 30}, timeout=40)
        t_done = time.perf_counter()
        if not res.get("done"):
            raise BenchError(f"job {job['id']} not done within 30 s: {res}")
        j = res["job"]
        if j["state"] != "completed" or j["exit_code"] != 0:
            raise BenchError(f"job {j['id']} of `true` ended {j['state']} "
                             f"exit={j['exit_code']} reason={j['reason']}")
        running = rfc3339_epoch(j["started_at"]) - wall
        return (t_ack - t0) * 1000, running * 1000, (t_done - t0) * 1000, j

    log(f"latency: {warmup} warm-up + {samples} sequential `true` jobs")
    for _ in range(warmup):
        one()
    ack, running, completed, run_to_done = [], [], [], []
    measured: list[int] = []
    for _ in range(samples):
        a, r, c, j = one()
        measured.append(j["id"])
        ack.append(a)
        running.append(r)
        completed.append(c)
        run_to_done.append((rfc3339_epoch(j["ended_at"]) - rfc3339_epoch(j["started_at"]))
                           * 1000)

    breakdown = phase_breakdown(agent, measured)

    log(f"latency: {visible_samples} `true` jobs polling `show` every 5 ms")
    visible: list[float] = []
    caught_running = 0
    for _ in range(visible_samples):
        t0 = time.perf_counter()
        jid = agent.submit(["true"])
        while True:
            st = agent.call("show", {"job": jid})["state"]
            if st not in ("pending", "starting"):
                visible.append((time.perf_counter() - t0) * 1000)
                caught_running += st == "running"
                break
            if time.perf_counter() - t0 > 30:
                raise BenchError(f"job {jid} not running after 30 s")
            time.sleep(0.005)
        agent.call("wait", {"job": jid, "hold": 30}, timeout=40)

    tether = os.path.join(os.path.dirname(sys.executable), "tether")
    if os.access(tether, os.X_OK):
        argv0 = [tether]
        with open(tether, "rb") as f:
            shebang = f.readline().decode(errors="replace").strip()
        interp = f"{tether} (entry-point script, {shebang}; -> {os.path.realpath(sys.executable)}"\
                 f" {platform.python_version()})"
    else:
        argv0 = [sys.executable, "-m", "tether.cli.main"]
        interp = f"{sys.executable} -m tether.cli.main ({platform.python_version()})"
    log(f"latency: {cli_samples} x `tether submit --wait -- true` via {argv0[0]}")
    cli_ms: list[float] = []
    for i in range(cli_samples + 1):
        t0 = time.perf_counter()
        res = subprocess.run([*argv0, "--state-dir", agent.state, "submit", "--wait", "--",
                              "true"], capture_output=True, text=True, cwd=agent.work,
                             timeout=60)
        dt = (time.perf_counter() - t0) * 1000
        if res.returncode != 0:
            raise BenchError(f"tether submit --wait failed rc={res.returncode}: {res.stderr}")
        if i:  # the first run is a warm-up (page cache)
            cli_ms.append(dt)
    imp_ms: list[float] = []
    for _ in range(5):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import tether.cli.main"], check=True, cwd=agent.work,
                       timeout=60)
        imp_ms.append((time.perf_counter() - t0) * 1000)
    return {
        "warmup_jobs": warmup,
        "submit_reply_ms": summary(ack),
        "submit_to_running_ms": summary(running, 0),
        "submit_to_completed_ms": summary(completed),
        "started_to_ended_ms": summary(run_to_done, 0),
        "submit_to_visible_running_ms": summary(visible),
        "visible_series_caught_running": f"{caught_running}/{visible_samples}",
        "cli_submit_wait_true_ms": summary(cli_ms),
        "cli_interpreter": interp,
        "python_import_cli_ms": summary(imp_ms),
        "phases": breakdown,
        "running_definition": "started_at (supervisor clock, ms resolution) - wall time "
                              "before submit",
    }


LOG_TS = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "


def _ts(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def phase_breakdown(agent: Agent, ids: list[int]) -> dict[str, Any]:
    """Where submit -> running goes, from the agent's and the supervisors' own log lines
    (same clock and time zone): spawn returned -> supervisor ready -> tasks launched."""
    spawned: dict[int, float] = {}
    ready: dict[int, float] = {}
    launched: dict[int, float] = {}
    with open(agent.logs[-1], errors="replace") as f:
        for m in re.finditer(LOG_TS + r"agent\[\d+\] INFO job (\d+) attempt 1: supervisor "
                             r"spawned", f.read(), re.M):
            spawned[int(m.group(2))] = _ts(m.group(1))
    with open(agent.layout.supervisor_log, errors="replace") as f:
        text = f.read()
    for m in re.finditer(LOG_TS + r"supervisor\[\d+\] job=(\d+)\.1 INFO (ready on|launched)",
                         text, re.M):
        (ready if m.group(3) == "ready on" else launched)[int(m.group(2))] = _ts(m.group(1))
    to_ready = [(ready[j] - spawned[j]) * 1000 for j in ids if j in ready and j in spawned]
    to_claim = [(launched[j] - ready[j]) * 1000 for j in ids if j in ready and j in launched]
    return {
        "spawn_to_ready_ms": summary(to_ready, 0),
        "ready_to_launched_ms": summary(to_claim, 0),
        "ready_to_launched_over_50ms": sum(x > 50 for x in to_claim),
    }


# ---- 2. restart with live jobs ----------------------------------------------------------------


def snapshot(agent: Agent, ids: list[int]) -> dict[int, dict[str, Any]]:
    jobs = {j["id"]: j for j in agent.call("list", {"limit": 500}, timeout=20)["jobs"]
            if j["id"] in ids}
    return jobs


def check_survivors(agent: Agent, before: dict[int, dict[str, Any]],
                    ticks: dict[int, int]) -> list[str]:
    problems = []
    now = snapshot(agent, list(before))
    for jid, old in before.items():
        j = now.get(jid)
        if j is None:
            problems.append(f"job {jid}: missing from `list`")
            continue
        if j["state"] != "running":
            problems.append(f"job {jid}: state {j['state']} (reason {j['reason']!r})")
        if j["attempt"] != old["attempt"]:
            problems.append(f"job {jid}: attempt {old['attempt']} -> {j['attempt']}")
        if j["supervisor_pid"] != old["supervisor_pid"]:
            problems.append(f"job {jid}: supervisor pid {old['supervisor_pid']} -> "
                            f"{j['supervisor_pid']}")
        if j["pids"] != old["pids"]:
            problems.append(f"job {jid}: pids {old['pids']} -> {j['pids']}")
        sp = old["supervisor_pid"]
        if not alive(sp, ticks.get(sp)):
            problems.append(f"job {jid}: supervisor {sp} is gone")
        for p in old["pids"]:
            if not alive(p):
                problems.append(f"job {jid}: task pid {p} is gone")
    return problems


def bench_restart(agent: Agent, njobs: int, restarts: int) -> dict[str, Any]:
    t0 = agent.start()
    empty_s = agent.wait_serving(t0)
    empty_log = agent.serving_ms()
    log(f"restart: empty agent served after {empty_s * 1000:.0f} ms; submitting {njobs} "
        "`sleep 120` jobs")
    t_sub = time.perf_counter()
    ids: list[int] = []
    rtt: list[float] = []
    for _ in range(njobs):
        t1 = time.perf_counter()
        ids.append(agent.submit(["sleep", "120"]))
        rtt.append((time.perf_counter() - t1) * 1000)
    submit_all_s = time.perf_counter() - t_sub

    def all_running() -> dict[int, dict[str, Any]] | None:
        jobs = snapshot(agent, ids)
        bad = [j for j in jobs.values() if j["state"] not in ("pending", "starting", "running")]
        if bad:
            ended = [(j["id"], j["state"], j["reason"]) for j in bad]
            raise BenchError(f"jobs ended early: {ended}")
        return jobs if all(j["state"] == "running" for j in jobs.values()) \
            and len(jobs) == njobs else None
    before = poll_until(all_running, 90, f"{njobs} jobs to be running", interval=0.1)
    all_running_s = time.perf_counter() - t_sub
    log(f"restart: {njobs} jobs running {all_running_s:.1f} s after the first submit")
    ticks = {}
    for j in before.values():
        st = proc_fields(j["supervisor_pid"])
        if st is not None:
            ticks[j["supervisor_pid"]] = st[3]
    sup_mem = []
    for j in before.values():
        with contextlib.suppress(OSError):
            sup_mem.append(mem_of(j["supervisor_pid"]))

    rounds = []
    for i in range(restarts):
        assert agent.proc is not None
        os.kill(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait(timeout=10)
        agent.close_client()
        time.sleep(0.2)
        t0 = agent.start()
        dt = agent.wait_serving(t0)
        served_log = agent.serving_ms()
        text = agent.log_text()
        m = REATTACH_RE.search(text)
        warn = [ln for ln in text.splitlines() if " WARNING " in ln or " ERROR " in ln]
        problems = check_survivors(agent, before, ticks)
        agent_mem = mem_of(agent.proc.pid)
        rounds.append({
            "popen_to_status_ms": round(dt * 1000, 1),
            "agent_log_serving_ms": served_log,
            "reattach_log": m.group(0) if m else None,
            "warnings": warn,
            "jobs_still_running": njobs - len({p.split(":")[0] for p in problems}),
            "problems": problems,
            "agent_rss_kb": agent_mem.get("VmRSS"),
            "agent_fds": agent_mem.get("fds"),
        })
        log(f"restart {i + 1}: status after {dt * 1000:.0f} ms (agent log: {served_log} ms); "
            f"{len(problems)} problem(s)")
    return {
        "jobs": njobs,
        "empty_agent_popen_to_status_ms": round(empty_s * 1000, 1),
        "empty_agent_log_serving_ms": empty_log,
        "submit_all_s": round(submit_all_s, 3),
        "submit_reply_ms_during_burst": summary(rtt),
        "first_submit_to_all_running_s": round(all_running_s, 2),
        "rounds": rounds,
        "median_popen_to_status_ms": round(statistics.median(
            r["popen_to_status_ms"] for r in rounds), 1),
        "median_agent_log_serving_ms": statistics.median(
            r["agent_log_serving_ms"] or 0 for r in rounds),
        "all_jobs_survived": all(not r["problems"] for r in rounds),
        "supervisors_with_50_running": {
            k: round(statistics.median(m[k] for m in sup_mem))
            for k in ("VmRSS", "Pss", "Threads", "fds") if sup_mem and k in sup_mem[0]
        },
    }


# ---- 3. supervisor footprint ------------------------------------------------------------------


def bench_footprint(agent: Agent, count: int, idle: float) -> dict[str, Any]:
    per = []
    for i in range(count):
        jid = agent.submit(["sleep", "60"])
        job = poll_until(lambda jid=jid: (j := agent.call("show", {"job": jid}))["state"]
                         == "running" and j, 30, f"job {jid} running")
        time.sleep(idle)
        sp = job["supervisor_pid"]
        with open(f"/proc/{sp}/cmdline", "rb") as f:
            title = f.read().split(b"\0")[0].decode(errors="replace").strip()
        m = mem_of(sp)
        m["pid"] = sp
        m["title"] = title  # type: ignore[assignment]
        per.append(m)
        log(f"footprint {i + 1}: supervisor {sp} ({title}): VmRSS {m['VmRSS']} kB, "
            f"Pss {m['Pss']} kB, {m['Threads']} threads, {m['fds']} fds")
        agent.call("cancel", {"job": jid})
        res = agent.call("wait", {"job": jid, "hold": 20}, timeout=30)
        if not res.get("done"):
            raise BenchError(f"job {jid} did not end after cancel")
    keys = ("VmRSS", "RssAnon", "RssFile", "Pss", "Pss_Anon", "Pss_File", "Private_Dirty",
            "Threads", "fds")
    return {
        "supervisors": per,
        "median": {k: round(statistics.median(m[k] for m in per)) for k in keys
                   if k in per[0]},
        "idle_before_reading_s": idle,
    }


# ---- report -----------------------------------------------------------------------------------


def fmt(s: dict[str, Any], unit: str = "ms") -> str:
    if not s.get("n"):
        return "no samples"
    return (f"median {s['median']} {unit}, p90 {s['p90']} {unit} "
            f"(min {s['min']}, max {s['max']}, n={s['n']})")


def report(r: dict[str, Any]) -> str:
    out = [
        "tether benchmark",
        f"  date {r['date']}, host {r['host']}, {r['cpus']} CPUs, python {r['python']}",
        f"  load average at start {r['load_start']}, at end {r['load_end']}; "
        f"other tether processes on the machine at start: {r['foreign_tether_processes']}",
        "  NOTE: the machine may be shared with other work (tests running concurrently);",
        "        latencies include that noise.",
        f"  total bench time {r['total_s']} s",
    ]
    lat = r.get("latency")
    if lat:
        ph = lat["phases"]
        out += [
            "",
            f"1. latency of `true` (in-process client; {lat['warmup_jobs']} warm-up jobs "
            "not counted)",
            f"   submit request round trip   {fmt(lat['submit_reply_ms'])}",
            f"   submit -> running           {fmt(lat['submit_to_running_ms'])}",
            f"        ({lat['running_definition']})",
            f"        of which: agent spawn returned -> supervisor ready "
            f"{fmt(ph['spawn_to_ready_ms'])}",
            f"                  supervisor ready -> task launched (claim arrives) "
            f"{fmt(ph['ready_to_launched_ms'])}; over 50 ms in "
            f"{ph['ready_to_launched_over_50ms']}/{ph['ready_to_launched_ms'].get('n', 0)}",
            f"   submit -> completed         {fmt(lat['submit_to_completed_ms'])}",
            f"   started_at -> ended_at      {fmt(lat['started_to_ended_ms'])}",
            f"   submit -> visible in `show` {fmt(lat['submit_to_visible_running_ms'])}",
            f"        (first non-pending/starting state; it was `running` in "
            f"{lat['visible_series_caught_running']}, otherwise already ended)",
            f"   CLI `tether submit --wait -- true` wall time: "
            f"{fmt(lat['cli_submit_wait_true_ms'])}",
            f"        interpreter: {lat['cli_interpreter']}",
            f"        for scale, `python -c 'import tether.cli.main'`: "
            f"{fmt(lat['python_import_cli_ms'])}",
        ]
    rs = r.get("restart")
    if rs:
        out += [
            "",
            f"2. agent start -> serving with {rs['jobs']} running jobs (--cpus 64, "
            "previous agent SIGKILLed)",
            f"   empty agent (no jobs): Popen -> status {rs['empty_agent_popen_to_status_ms']}"
            f" ms, agent log {rs['empty_agent_log_serving_ms']} ms",
            f"   {rs['jobs']} submits took {rs['submit_all_s']} s (each reply: "
            f"{fmt(rs['submit_reply_ms_during_burst'])});",
            f"   all running {rs['first_submit_to_all_running_s']} s after the first submit",
        ]
        for i, rd in enumerate(rs["rounds"], 1):
            out.append(f"   restart {i}: Popen -> status answers {rd['popen_to_status_ms']} ms;"
                       f" agent log 'serving after' {rd['agent_log_serving_ms']} ms; "
                       f"{rd['jobs_still_running']}/{rs['jobs']} jobs still running; "
                       f"agent RSS {rd['agent_rss_kb']} kB, {rd['agent_fds']} fds")
            if rd["reattach_log"]:
                out.append(f"             {rd['reattach_log']}")
            for w in rd["warnings"][:5]:
                out.append(f"             log: {w}")
            for p in rd["problems"][:10]:
                out.append(f"             PROBLEM: {p}")
        out.append(f"   median: Popen -> status {rs['median_popen_to_status_ms']} ms, agent log "
                   f"{rs['median_agent_log_serving_ms']} ms; all jobs survived: "
                   f"{'yes' if rs['all_jobs_survived'] else 'NO'}")
        sm = rs["supervisors_with_50_running"]
        if sm:
            out.append(f"   (median supervisor with {rs['jobs']} alive: VmRSS {sm['VmRSS']} kB,"
                       f" Pss {sm['Pss']} kB, {sm['Threads']} threads, {sm['fds']} fds)")
    fp = r.get("footprint")
    if fp:
        m = fp["median"]
        out += [
            "",
            f"3. idle supervisor (one `sleep 60` job at a time, read {fp['idle_before_reading_s']}"
            " s after it was running)",
        ]
        for s in fp["supervisors"]:
            out.append(f"   pid {s['pid']}: VmRSS {s['VmRSS']} kB, Pss {s['Pss']} kB, "
                       f"{s['Threads']} threads, {s['fds']} fds")
        out.append(f"   median of {len(fp['supervisors'])}: VmRSS {m['VmRSS']} kB (anon "
                   f"{m.get('RssAnon')}, file {m.get('RssFile')}), Pss {m['Pss']} kB (anon "
                   f"{m.get('Pss_Anon')}, file {m.get('Pss_File')}), {m['Threads']} threads, "
                   f"{m['fds']} fds")
    if r.get("error"):
        out += ["", f"ERROR: {r['error']}"]
    out.append(f"\ncleanup: {r.get('cleanup', '?')}")
    return "\n".join(out)


# ---- main -------------------------------------------------------------------------------------


def _on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--samples", type=int, default=30, help="`true` jobs for latency (30)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--visible-samples", type=int, default=10)
    p.add_argument("--cli-samples", type=int, default=10)
    p.add_argument("--jobs", type=int, default=50, help="live jobs across restarts (50)")
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--supervisors", type=int, default=3, help="supervisors to weigh (3)")
    p.add_argument("--idle", type=float, default=1.0,
                   help="seconds a supervisor sits idle before it is weighed")
    p.add_argument("--only", choices=["latency", "restart", "footprint"], action="append",
                   help="run only these parts (repeatable)")
    ns = p.parse_args(argv)
    parts = set(ns.only or ["latency", "restart", "footprint"])

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    subreaper = become_subreaper()
    root = tempfile.mkdtemp(dir="/tmp", prefix="tb")
    cleaner = Cleaner(root)
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": f"{sys.executable} ({platform.python_version()})",
        "load_start": cpu_load(),
        "foreign_tether_processes": foreign_tether_processes(root.encode()),
        "subreaper": subreaper,
        "state_root": root,
    }
    rc = 0
    try:
        if parts & {"latency", "footprint"}:
            a = Agent(root, "a", 4)
            cleaner.agents.append(a)
            a.wait_serving(a.start())
            if "latency" in parts:
                result["latency"] = bench_latency(a, ns.samples, ns.warmup, ns.visible_samples,
                                                  ns.cli_samples)
            if "footprint" in parts:
                log(f"footprint: {ns.supervisors} supervisors, one at a time")
                result["footprint"] = bench_footprint(a, ns.supervisors, ns.idle)
            a.kill()
        if "restart" in parts:
            b = Agent(root, "b", 64)
            cleaner.agents.append(b)
            result["restart"] = bench_restart(b, ns.jobs, ns.restarts)
            b.kill()
    except (BenchError, TetherError, OSError, subprocess.SubprocessError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        rc = 1
        for ag in cleaner.agents:
            if ag.logs:
                log(f"agent log {ag.logs[-1]}:\n{ag.tail()}")
    finally:
        # a second signal must not cut the cleanup short
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGHUP, signal.SIGINT})
        killed = cleaner.run()
        left = [pid for pid in descendants_of_me() if alive(pid)]
        result["cleanup"] = (f"killed {len(killed)} leftover process(es) "
                             f"(agents, supervisors, jobs); removed {root}; "
                             f"still alive: {left or 'none'}")
        log(result["cleanup"])
    result["load_end"] = cpu_load()
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    if ns.json:
        print(json.dumps(result, indent=2))
    else:
        print(report(result))
    return rc


if __name__ == "__main__":
    sys.exit(main())
