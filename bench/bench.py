"""tether's launch, footprint and agent benchmarks: every row of issue 10's table.

    .venv/bin/python bench/bench.py                  # every part, readable report on stdout
    .venv/bin/python bench/bench.py --json           # one JSON object instead
    .venv/bin/python bench/bench.py --only spawn --only cli --runs 20
    .venv/bin/python bench/bench.py --only steps --steps 1000   # the long one

Every process-start figure is measured in one loop together with ``python3 -I -c pass`` (the
machine-speed reference: the ratio is printed), and, where Slurm is reachable (``SLURM_CONF``
set and ``srun`` on PATH; ``bench/slurm_local.py`` starts a throwaway one), together with Slurm's
own command for the same thing (``bench/slurm_side.py``). Progress goes
to stderr. Everything runs on short scratch state directories under one
``tempfile.mkdtemp(dir="/tmp")``; what the run started is killed on the way out (see
``harness.Cleaner``). Parts:

- ``cli``: ``tether submit --wait -- true`` (the console script) vs ``srun -N1 -n1 true``;
- ``spawn``: supervisor spawn -> ready (its socket bound: the ready pipe's byte), forked from
  the template (warm) and started with ``python -I -m tether.supervisor`` (cold), measured
  directly on the template's socket and the supervisor's ready pipe, no agent involved;
- ``launch``: in-process ``submit`` -> running -> completed, and where it goes (the agent's and
  supervisors' log lines: spawned -> ready -> launched);
- ``inspect``: ``tether inspect JOB --json`` vs ``scontrol listpids`` (of a running job that
  runs an ``srun sleep`` step, started for the part);
- ``throughput``: 200 ``true`` jobs submitted back to back by one in-process client (agent
  ``--cpus 64``), first submit to last completion; then by 8 clients at once; with ``--busy N``
  also by one client while N ``sleep`` steps run (the agent follows every supervisor);
  Slurm: as many ``sbatch --wrap true`` back to back, first submit to the last one gone;
- ``steps``: N ``sleep`` jobs (100 by default) started at once (``status`` round trips timed
  while they start), weighed from ``/proc/PID/smaps_rollup`` after they have all run for
  ``--idle`` (60) seconds, then the agent SIGKILLed and restarted 3 times: Popen -> ``status``
  answers, and the agent's own "serving after" figure (which covers the reattach);
  with ``--ksm``, the agent runs with ``--ksm`` and, when the bench is root, ksmd runs for the
  part (``/sys/kernel/mm/ksm/run`` set to 1, its value put back on the way out); Slurm: as
  many ``srun --overlap sleep`` steps of one job, each slurmstepd weighed after ``--idle``;
- ``mpi``: MPICH 2-rank hello under ``tether submit --wait --pmi pmi1`` vs ``mpiexec -n 2``
  (and ``srun -N1 -n2 --mpi=pmi2``); tether's ranks load the agent's hwloc XML, so
  ``mpiexec -n 2`` given the same file is timed too.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import slurm_side  # noqa: E402
from bench.harness import (  # noqa: E402
    REATTACH_RE,
    Agent,
    BenchError,
    Cleaner,
    CpuAccount,
    alive,
    become_subreaper,
    cpu_load,
    descendants_of_me,
    log,
    mem_of,
    poll_until,
    rfc3339_epoch,
    summary,
)
from tether.shared import records, template_wire  # noqa: E402
from tether.shared.client import Client  # noqa: E402
from tether.shared.errors import TetherError  # noqa: E402
from tether.shared.paths import Layout  # noqa: E402
from tether.supervisor.launch import hwloc_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the machine-speed reference: the interpreter tether itself runs on (not a pyenv shim on PATH)
REFERENCE = [sys.executable, "-I", "-c", "pass"]
PARTS = ("cli", "spawn", "launch", "inspect", "throughput", "steps", "mpi")
slurm = slurm_side.available


def tether_cli() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "tether")
    return [script] if os.access(script, os.X_OK) else [sys.executable, "-m", "tether.cli.main"]


def timed(argv: list[str], **kw: Any) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, timeout=120, **kw)
    ms = (time.perf_counter() - t0) * 1000
    if res.returncode != 0:
        raise BenchError(f"{' '.join(argv)} exited {res.returncode}: "
                         f"{res.stderr.decode(errors='replace')[-500:]}")
    return ms


def paired(runs: int, commands: dict[str, Callable[[], float]]) -> dict[str, Any]:
    """Each command once per round, in the same order, after one warm-up round; medians and
    every command's ratio to the reference (``python``) measured in those same rounds."""
    samples: dict[str, list[float]] = {k: [] for k in commands}
    for i in range(runs + 1):
        for name, run in commands.items():
            ms = run()
            if i:
                samples[name].append(ms)
    out: dict[str, Any] = {k: summary(v) for k, v in samples.items()}
    ref = statistics.median(samples["python"])
    for name, values in samples.items():
        out[name]["x_python"] = round(statistics.median(values) / ref, 2)
    return out


# ---- cli, inspect ---------------------------------------------------------------------------


def bench_cli(agent: Agent, runs: int) -> dict[str, Any]:
    log(f"cli: {runs} rounds of submit --wait -- true / python3 -I -c pass / in-process"
        + (" / srun" if slurm() else ""))

    def in_process() -> float:  # the same job through this process's client: no CLI start
        t0 = time.perf_counter()
        job = agent.submit(["true"])
        agent.call("wait", {"job": job, "hold": 30}, timeout=40)
        return (time.perf_counter() - t0) * 1000
    cmds: dict[str, Callable[[], float]] = {
        "python": lambda: timed(REFERENCE),
        "tether": lambda: timed([*tether_cli(), "--state-dir", agent.state, "submit", "--wait",
                                 "--", "true"], cwd=agent.work),
        "in_process": in_process,
    }
    if slurm():
        cmds["srun"] = lambda: timed(["srun", "-N1", "-n1", "true"])
    out = {"argv0": tether_cli()[0], **paired(runs, cmds)}
    # what the command line adds to the job: its start, parsing, connecting, its exit
    out["cli_own_ms"] = round(out["tether"]["median"] - out["in_process"]["median"], 1)
    return out


def bench_inspect(agent: Agent, runs: int) -> dict[str, Any]:
    job = agent.submit(["sleep", "300"])
    poll_until(lambda: agent.call("show", {"job": job})["state"] == "running", 30,
               f"job {job} running")
    cmds: dict[str, Callable[[], float]] = {
        "python": lambda: timed(REFERENCE),
        "tether": lambda: timed([*tether_cli(), "--state-dir", agent.state, "inspect", str(job),
                                 "--json"], cwd=agent.work),
    }
    with contextlib.ExitStack() as stack:
        if slurm():
            sjob = str(stack.enter_context(slurm_side.running_step()))
            cmds["scontrol"] = lambda: timed(["scontrol", "listpids", sjob])
        log(f"inspect: {runs} rounds of {' / '.join(cmds)} (tether job {job})")
        out = paired(runs, cmds)
    agent.call("cancel", {"job": job})
    agent.call("wait", {"job": job, "hold": 20}, timeout=30)
    return out


# ---- spawn -> ready, without an agent ---------------------------------------------------------


class SpawnRig:
    """A state directory with a template and no agent: run directories made by hand, spawned
    through the template's socket or with ``python -I -m tether.supervisor``; ready = the byte
    on the ready pipe. Every supervisor is SIGTERMed once ready (it aborts, unclaimed)."""

    def __init__(self, root: str) -> None:
        self.layout = Layout(os.path.join(root, "spawn"))
        os.makedirs(self.layout.run_root)
        self.env = {k: v for k, v in os.environ.items()
                    if k.startswith(("PYTHON", "LANG", "LC_", "TETHER_"))}
        self.env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
        self.jobs = 0
        self.template = subprocess.Popen(
            [sys.executable, "-I", "-m", "tether.supervisor.template", "--socket",
             self.layout.template_sock], stdin=subprocess.DEVNULL,
            stderr=open(self.layout.supervisor_log, "ab"),  # noqa: SIM115
            start_new_session=True, cwd="/")
        poll_until(lambda: os.path.exists(self.layout.template_sock), 30, "the template")

    def run_dir(self) -> tuple[str, int]:
        self.jobs += 1
        rd = self.layout.run_dir(self.jobs, 1)
        os.mkdir(rd.path, 0o711)
        records.atomic_write_json(rd.spec, {
            "schema": records.SCHEMA, "job": self.jobs, "attempt": 1, "name": "bench",
            "command": ["true"], "ntasks": 1, "cpus": [0], "gpus": [], "memory_mb": 0,
            "affinity": [[0]], "env": {}, "workdir": "/", "output": "/dev/null",
            "error": "/dev/null", "claim_timeout": 30, "linger": 30, "kill_grace": 1,
            "agent_uid": os.getuid(), "pmi": "none", "uid": os.getuid(), "gid": os.getgid(),
            "groups": [], "user": "root", "home": "/"})
        lock = os.open(rd.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        import fcntl
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return rd.path, lock

    def warm(self) -> float:
        path, lock = self.run_dir()
        r, w = os.pipe()
        logf = os.open(self.layout.supervisor_log, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        t0 = time.perf_counter()
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(self.layout.template_sock)
            socket.send_fds(s, [template_wire.spawn_request(path, self.env, 0o022)],
                            [lock, logf, w])
            os.close(w)
            ms = self._ready(r, t0)
            pid = template_wire.decode(s.recv(65536))["pid"]
        for fd in (lock, logf, r):
            os.close(fd)
        self._stop(pid)
        return ms

    def cold(self) -> float:
        path, lock = self.run_dir()
        r, w = os.pipe()
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-I", "-m", "tether.supervisor", "--run-dir", path, "--lock-fd",
             str(lock), "--ready-fd", str(w)], pass_fds=(lock, w), env=self.env, cwd="/",
            stdin=subprocess.DEVNULL, stderr=open(self.layout.supervisor_log, "ab"))  # noqa: SIM115
        os.close(w)
        ms = self._ready(r, t0)
        os.close(lock)
        os.close(r)
        self._stop(proc.pid)
        proc.wait(timeout=30)
        return ms

    def _ready(self, r: int, t0: float) -> float:
        if os.read(r, 1) != b"r":
            raise BenchError(f"a supervisor exited before it was ready; see "
                             f"{self.layout.supervisor_log}")
        return (time.perf_counter() - t0) * 1000

    def _stop(self, pid: int) -> None:
        os.kill(pid, signal.SIGTERM)  # ready, unclaimed: it aborts and removes its run dir
        poll_until(lambda: not alive(pid), 30, f"supervisor {pid} to exit")

    def close(self) -> None:
        self.template.kill()
        self.template.wait()


def bench_spawn(root: str, runs: int) -> dict[str, Any]:
    log(f"spawn: {runs} rounds of warm / cold supervisor spawn -> ready / python3 -I -c pass")
    rig = SpawnRig(root)
    try:
        return paired(runs, {"python": lambda: timed(REFERENCE), "warm": rig.warm,
                             "cold": rig.cold})
    finally:
        rig.close()


# ---- launch latency (in-process) --------------------------------------------------------------

LOG_TS = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "


def _ts(text: str) -> float:
    from datetime import datetime
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def bench_launch(agent: Agent, runs: int) -> dict[str, Any]:
    log(f"launch: {runs} sequential `true` jobs, in-process client")
    reply, running, done, ids, py = [], [], [], [], []
    for i in range(runs + 2):
        wall, t0 = time.time(), time.perf_counter()
        jid = agent.submit(["true"])
        t1 = time.perf_counter()
        res = agent.call("wait", {"job": jid, "hold": 30}, timeout=40)
        t2 = time.perf_counter()
        j = res["job"]
        if j["state"] != "completed":
            raise BenchError(f"job {jid} of `true` ended {j['state']}: {j['reason']}")
        ref = timed(REFERENCE)  # the machine-speed reference, in the same loop
        if i >= 2:  # two warm-up jobs
            ids.append(jid)
            reply.append((t1 - t0) * 1000)
            running.append((rfc3339_epoch(j["started_at"]) - wall) * 1000)
            done.append((t2 - t0) * 1000)
            py.append(ref)
    # where submit -> running goes: the agent's "spawned" and the supervisors' own lines
    with open(agent.logs[-1], errors="replace") as f:
        text = f.read()
    spawned = {int(m.group(2)): _ts(m.group(1)) for m in re.finditer(
        LOG_TS + r"agent\[\d+\] INFO job (\d+) attempt 1: supervisor spawned", text, re.M)}
    with open(agent.layout.supervisor_log, errors="replace") as f:
        text = f.read()
    marks: dict[str, dict[int, float]] = {"ready on": {}, "launched": {}, "step ended": {}}
    warm = 0
    for m in re.finditer(LOG_TS + r"supervisor\[\d+\] job=(\d+)\.1 INFO "
                         r"(ready on|launched|step ended)(.*)$", text, re.M):
        marks[m.group(3)][int(m.group(2))] = _ts(m.group(1))
        warm += m.group(3) == "ready on" and int(m.group(2)) in ids and "(warm" in m.group(4)

    def between(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
        return summary([(b[j] - a[j]) * 1000 for j in ids if j in a and j in b], 0)
    ready, launched, ended = marks["ready on"], marks["launched"], marks["step ended"]
    return {
        "submit_reply_ms": summary(reply, 2),
        "submit_to_running_ms": summary(running, 0),
        "submit_to_completed_ms": summary(done),
        "ready_to_launched_ms": between(ready, launched),
        "spawned_to_ready_ms": between(spawned, ready),
        "launched_to_ended_ms": between(launched, ended),
        "python_ms": summary(py),
        "x_python": round(statistics.median(done) / statistics.median(py), 2),
        "warm_starts": f"{warm}/{len(ids)}",
    }


# ---- throughput -------------------------------------------------------------------------------


def bench_throughput(root: str, jobs: int, submitters: int = 1, name: str = "t",
                     accounts: list[CpuAccount] | None = None,
                     busy: int = 0) -> tuple[dict[str, Any], Agent]:
    """``jobs`` ``true`` jobs: one client submitting back to back (each submit waits for its
    reply), or ``submitters`` clients (threads, one connection each) doing so at once, so
    that several submits arrive in one turn of the agent's loop (group commit). The CPU time
    of every process of the run (this client, agent, template, supervisors, tasks) is counted
    in a cgroup of its own (``CpuAccount``), where the host has the v1 cpuacct hierarchy.
    ``busy``: that many ``sleep`` steps are started first and run meanwhile (a busy node:
    the agent follows each one's supervisor)."""
    acct = CpuAccount(f"tb{name}")
    if accounts is not None:
        accounts.append(acct)
    agent = Agent(root, name, 64 + busy)
    agent.wait_serving(agent.start())
    wait_template(agent)
    if busy:
        log(f"throughput: {busy} `sleep` steps first")
        with Client(agent.sock, timeout=30) as c:
            for _ in range(busy):
                c.call("submit", {"command": ["sleep", "3600"], "workdir": agent.work})
        poll_until(lambda: agent.call("status")["jobs"]["running"] >= busy, 300,
                   f"{busy} sleep steps to run")
    log(f"throughput: {jobs} `true` jobs back to back (--cpus {64 + busy}), {submitters} "
        f"submitter(s){f', {busy} steps running' if busy else ''}")
    per = [jobs // submitters + (1 if i < jobs % submitters else 0) for i in range(submitters)]
    replies: list[float] = []
    ids: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def submit_some(n: int) -> None:
        try:
            with Client(agent.sock, timeout=30) as c:
                for _ in range(n):
                    t = time.perf_counter()
                    res = c.call("submit", {"command": ["true"], "workdir": agent.work,
                                            "env": dict(os.environ)}, timeout=30)
                    with lock:
                        replies.append((time.perf_counter() - t) * 1000)
                        ids.append(int(res["id"]))
        except BaseException as exc:
            errors.append(exc)

    # the machine-speed reference, just before (the loop below keeps both CPUs busy: one
    # measured during it would weigh the load, not the machine)
    python_ms = statistics.median(timed(REFERENCE) for _ in range(10))
    syncs0 = agent.call("status").get("db_syncs")
    assert agent.proc is not None
    cpu0 = cpu_seconds(agent.proc.pid)
    all0 = acct.usage()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=submit_some, args=(n,)) for n in per]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise BenchError(f"a submitter failed: {errors[0]!r}")
    t_submitted = time.perf_counter()
    for jid in ids:
        res = agent.call("wait", {"job": jid, "hold": 60}, timeout=70)
        if not res.get("done") or res["job"]["state"] != "completed":
            raise BenchError(f"job {jid}: {res}")
    total = time.perf_counter() - t0
    syncs = agent.call("status").get("db_syncs")  # group commit (absent before it)
    cpu = cpu_seconds(agent.proc.pid) - cpu0
    all1 = acct.usage()
    acct.leave()
    return {"jobs": jobs, "submitters": submitters, "busy": busy, "total_s": round(total, 2),
            "agent_cpu_ms_per_job": round(cpu * 1000 / jobs, 2),
            "all_cpu_ms_per_job": None if all0 is None or all1 is None
            else round((all1 - all0) * 1000 / jobs, 2),
            "db_syncs_per_job": None if syncs is None or syncs0 is None
            else round((syncs - syncs0) / jobs, 2),
            "jobs_per_s": round(jobs / total, 1),
            "python_ms": round(python_ms, 1),
            # jobs in the time of one `python -I -c pass`: the figure that a faster or slower
            # host moves least (the goal, 100 jobs/s, at the 11 ms interpreter: 1.1)
            "jobs_per_python": round(jobs / total * python_ms / 1000, 2),
            "submit_all_s": round(t_submitted - t0, 2),
            "submit_reply_ms": summary(replies, 2)}, agent


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (its own, threads included), from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        rest = f.read().rsplit(b")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def wait_template(agent: Agent) -> None:
    def up() -> bool:
        try:
            with open(agent.layout.supervisor_log) as f:
                return " template[" in f.read()
        except FileNotFoundError:
            return False
    poll_until(up, 30, "the supervisor template")


# ---- steps: memory after idling, status while starting, agent restart ----------------------


def supervisors_of(agent: Agent, ids: list[int]) -> dict[int, int]:
    return {j: int(agent.call("show", {"job": j})["supervisor_pid"]) for j in ids}


KSM = "/sys/kernel/mm/ksm/"


def ksm_counters() -> dict[str, int]:
    """ksmd's host-wide counters (pages: 4 KiB each here), {} without KSM."""
    out = {}
    for name in ("run", "pages_shared", "pages_sharing", "full_scans"):
        try:
            with open(KSM + name) as f:
                out[name] = int(f.read())
        except (OSError, ValueError):
            pass
    return out


def ksmd_on() -> str | None:
    """Start ksmd for this run (root only); the value to put back, None if nothing changed."""
    try:
        with open(KSM + "run") as f:
            before = f.read().strip()
    except OSError:
        log("steps --ksm: this kernel has no KSM; ksmd not started")
        return None
    if os.geteuid() != 0:
        log(f"steps --ksm: not root, ksmd left as it is (run = {before})")
        return None
    if before != "1":
        with open(KSM + "run", "w") as f:
            f.write("1")
        log(f"steps --ksm: ksmd started for this run (run was {before})")
    return before


def ksmd_restore(before: str | None) -> None:
    if before is not None and before != "1":
        with open(KSM + "run", "w") as f:
            f.write(before)
        log(f"steps --ksm: ksmd run = {before} again")


def bench_steps(root: str, steps: int, idle: float, restarts: int,
                ksm: bool = False) -> dict[str, Any]:
    agent = Agent(root, f"n{steps}", steps + 8, ("--ksm",) if ksm else ())
    agent.wait_serving(agent.start())
    wait_template(agent)
    log(f"steps: {steps} `sleep` jobs; status timed (every 5 ms, own connection) while they "
        "are submitted and start")
    status_ms: list[float] = []
    stop = threading.Event()
    kernel_before, ksmd_before = _kernel_mem(), ksmd_cpu_s()

    def poll_status() -> None:
        with Client(agent.sock, timeout=30) as c:
            while not stop.is_set():
                t = time.perf_counter()
                c.call("status")
                status_ms.append((time.perf_counter() - t) * 1000)
                time.sleep(0.005)
    poller = threading.Thread(target=poll_status, daemon=True)
    t0 = time.perf_counter()
    poller.start()
    try:
        ids = [agent.submit(["sleep", "3600"]) for _ in range(steps)]
        poll_until(lambda: agent.call("status")["jobs"].get("running", 0) == steps, 600,
                   f"all {steps} jobs running", interval=0.01)
    finally:
        stop.set()
        poller.join(30)
    all_running = time.perf_counter() - t0
    log(f"steps: all {steps} submitted and running after {all_running:.1f} s; idling {idle:g} s")
    time.sleep(idle)
    sups = supervisors_of(agent, ids)
    mems = [mem_of(p) for p in sups.values()]
    template = [p for p in descendants_of_me() if _title(p).startswith("tether-template")]
    tmem = mem_of(template[0]) if template else {}
    for m in mems:
        m["Uss"] = m.get("Private_Clean", 0) + m.get("Private_Dirty", 0)
    med = {k: statistics.median(m[k] for m in mems) for k in
           ("Pss", "Pss_Anon", "Pss_File", "Uss", "VmRSS", "Threads", "fds")}
    total_kb = _meminfo("MemTotal")
    out: dict[str, Any] = {
        "steps": steps, "submit_to_all_running_s": round(all_running, 2),
        "status_while_starting_ms": summary(status_ms, 2),
        "idle_s": idle, "supervisor_median": med,
        "supervisors_pss_sum_mib": round(sum(m["Pss"] for m in mems) / 1024, 1),
        "template": {k: tmem.get(k) for k in ("Pss", "VmRSS")},
        "agent": {k: mem_of(agent.proc.pid).get(k) for k in ("Pss", "VmRSS", "fds")}
        if agent.proc else {},
        "mem_total_mib": round(total_kb / 1024, 1),
        "steps_that_fit": int(total_kb / med["Pss"]),
        "ksm": ksm_counters() if ksm else None,
        # kernel memory that PSS leaves out (page tables, threads' kernel stacks, the slab
        # caches: mappings, tasks, sockets, cgroups, ksmd's records): what it grew by while
        # the steps started and idled, per step (other processes' moves are in it too)
        "kernel_per_step_kib": {k: round((v - kernel_before[k]) / steps, 1)
                                for k, v in _kernel_mem().items()},
        "ksmd_cpu_s": round(ksmd_cpu_s() - ksmd_before, 2) if ksm else None,
    }
    rounds = []
    for i in range(restarts):
        agent.kill()
        t = agent.start()
        dt = agent.wait_serving(t, interval=0.002)
        # status while the supervisors answer the new agent: how long one waits at worst
        during: list[float] = []
        with Client(agent.sock, timeout=30) as c:
            until = time.perf_counter() + 2.0
            while time.perf_counter() < until:
                t1 = time.perf_counter()
                c.call("status")
                during.append((time.perf_counter() - t1) * 1000)
                time.sleep(0.002)
        text = agent.log_text()
        m = re.search(r"agent serving on \S+ after (\d+) ms", text)
        r = REATTACH_RE.search(text)
        still = sum(1 for p in sups.values() if alive(p))
        rounds.append({"popen_to_status_ms": round(dt * 1000, 1),
                       "agent_log_serving_ms": int(m.group(1)) if m else None,
                       "status_next_2s_ms": {"median": round(statistics.median(during), 2),
                                             "max": round(max(during), 1)},
                       "reattach": r.group(0) if r else None, "supervisors_alive": still})
        log(f"steps: restart {i + 1}: status after {dt * 1000:.0f} ms, agent log "
            f"{rounds[-1]['agent_log_serving_ms']} ms, {still}/{steps} supervisors alive")
    out["restarts"] = rounds
    if rounds:
        out["restart_median_log_ms"] = statistics.median(
            r["agent_log_serving_ms"] or 0 for r in rounds)
        out["restart_median_status_ms"] = round(statistics.median(
            r["popen_to_status_ms"] for r in rounds), 1)  # the median of two is their mean
    # every job still running, under the same supervisor
    after = supervisors_of(agent, ids)
    out["same_supervisors_after_restarts"] = after == sups
    agent.kill()
    return out


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def ksmd_cpu_s() -> float:
    """CPU time ksmd (a kernel thread) has used, 0 where there is none."""
    for comm in glob.glob("/proc/[0-9]*/comm"):
        try:
            with open(comm) as f:
                if f.read().strip() == "ksmd":
                    return cpu_seconds(int(comm.split("/")[2]))
        except OSError:
            continue
    return 0.0


def _kernel_mem() -> dict[str, int]:
    return {k: _meminfo(k) for k in ("PageTables", "KernelStack", "Slab")}


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


# ---- mpi --------------------------------------------------------------------------------------


def bench_mpi(agent: Agent, runs: int) -> dict[str, Any]:
    # MPICH's own names: the plain ones follow Debian's alternatives, which Open MPI can take
    if not shutil.which("mpicc.mpich") or not shutil.which("mpiexec.mpich"):
        return {"skipped": "mpicc.mpich or mpiexec.mpich not found (Debian's mpich)"}
    exe = os.path.join(agent.dir, "hello_mpi")
    subprocess.run(["mpicc.mpich", "-O1", "-o", exe, os.path.join(ROOT, "tests/mpi/hello_mpi.c")],
                   check=True)
    # tether's PMI ranks load the agent's hwloc XML (agent/topology.py); mpiexec as people run
    # it does not, and is the goal's reference. The same XML given to mpiexec by hand is
    # measured too, so the report says how much of the figure that file is.
    xml = wait_topology(agent)
    xml_env = dict(os.environ, **hwloc_env(xml)) if xml else None
    log(f"mpi: {runs} rounds of 2-rank MPICH hello: tether / mpiexec / python3 -I -c pass"
        + (" / mpiexec with tether's hwloc XML" if xml else " (no hwloc XML: no lstopo)")
        + (" / srun --mpi=pmi2" if slurm() else ""))
    cmds: dict[str, Callable[[], float]] = {
        "python": lambda: timed(REFERENCE),
        "tether": lambda: timed([*tether_cli(), "--state-dir", agent.state, "submit", "--wait",
                                 "--ntasks", "2", "--pmi", "pmi1", "--", exe], cwd=agent.work),
        "mpiexec": lambda: timed(["mpiexec.mpich", "-n", "2", exe], cwd=agent.work),
    }
    if xml_env is not None:
        cmds["mpiexec_xml"] = lambda: timed(["mpiexec.mpich", "-n", "2", exe], cwd=agent.work,
                                            env=xml_env)
    if slurm():
        cmds["srun"] = lambda: timed(["srun", "-N1", "-n2", "--mpi=pmi2", exe])
    out = paired(runs, cmds)
    out["x_mpiexec"] = round(out["tether"]["median"] / out["mpiexec"]["median"], 2)
    if "mpiexec_xml" in out:
        out["x_mpiexec_xml"] = round(out["tether"]["median"] / out["mpiexec_xml"]["median"], 2)
    return out


def wait_topology(agent: Agent) -> str | None:
    """The agent's hwloc XML once gathered (~20 ms after it serves), or None without lstopo."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        res = subprocess.run([*tether_cli(), "--state-dir", agent.state, "status", "--json"],
                             capture_output=True, text=True, timeout=30)
        xml = json.loads(res.stdout).get("hwloc_xml") if res.returncode == 0 else None
        if xml or not shutil.which("lstopo-no-graphics"):
            return xml or None
        time.sleep(0.05)
    raise BenchError("the agent gathered no hwloc topology within 30 s")


# ---- main -------------------------------------------------------------------------------------


def _on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    from bench.report import report

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--only", choices=PARTS, action="append", help="run only these parts")
    p.add_argument("--runs", type=int, default=10, help="rounds of each paired timing (10)")
    p.add_argument("--steps", type=int, default=100, help="concurrent steps to weigh (100)")
    p.add_argument("--idle", type=float, default=60.0,
                   help="seconds the steps run before they are weighed (60)")
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--jobs", type=int, default=200, help="jobs for the throughput part")
    p.add_argument("--submitters", type=int, default=8,
                   help="concurrent clients in the throughput part's second run")
    p.add_argument("--busy", type=int, default=0,
                   help="a third throughput run, one client, with this many sleep steps "
                        "running meanwhile (0: none)")
    p.add_argument("--ksm", action="store_true",
                   help="steps: the agent runs with --ksm, and if this is root ksmd runs for "
                   "the part (/sys/kernel/mm/ksm/run, put back afterwards)")
    ns = p.parse_args(argv)
    parts = set(ns.only or PARTS)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    become_subreaper()
    root = tempfile.mkdtemp(dir="/tmp", prefix="tb")
    cleaner = Cleaner(root)
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
        "cpus": os.cpu_count(), "python": f"{sys.executable} ({platform.python_version()})",
        "load_start": cpu_load(), "slurm": slurm(), "state_root": root,
    }
    rc = 0
    ksm_before: str | None = None
    try:
        if "spawn" in parts:
            result["spawn"] = bench_spawn(root, ns.runs)
        if parts & {"cli", "launch", "inspect", "mpi"}:
            a = Agent(root, "a", 4)
            cleaner.agents.append(a)
            a.wait_serving(a.start())
            wait_template(a)
            if "cli" in parts:
                result["cli"] = bench_cli(a, ns.runs)
            if "launch" in parts:
                result["launch"] = bench_launch(a, 2 * ns.runs)
            if "inspect" in parts:
                result["inspect"] = bench_inspect(a, ns.runs)
            if "mpi" in parts:
                result["mpi"] = bench_mpi(a, ns.runs)
            a.kill()
        if "throughput" in parts:
            result["throughput"], t = bench_throughput(root, ns.jobs,
                                                       accounts=cleaner.accounts)
            cleaner.agents.append(t)
            t.kill()
            if slurm():
                result["throughput"]["sbatch"] = slurm_side.throughput(ns.jobs)
            result["throughput_concurrent"], t = bench_throughput(root, ns.jobs, ns.submitters,
                                                                  "tc", cleaner.accounts)
            cleaner.agents.append(t)
            t.kill()
            if ns.busy:
                result["throughput_busy"], t = bench_throughput(
                    root, ns.jobs, 1, "tb", cleaner.accounts, busy=ns.busy)
                cleaner.agents.append(t)
                t.kill()
        if "steps" in parts:
            if ns.ksm:
                ksm_before = ksmd_on()
            result["steps"] = bench_steps(root, ns.steps, ns.idle, ns.restarts, ns.ksm)
            if slurm():
                result["steps"]["slurm"] = slurm_side.steps(ns.steps, ns.idle)
    except (BenchError, TetherError, OSError, subprocess.SubprocessError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        rc = 1
        for ag in cleaner.agents:
            if ag.logs:
                log(f"agent log {ag.logs[-1]}:\n{ag.tail()}")
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGHUP, signal.SIGINT})
        try:
            ksmd_restore(ksm_before)
        finally:
            killed = cleaner.run()
        left = [pid for pid in descendants_of_me() if alive(pid)]
        result["cleanup"] = (f"killed {len(killed)} leftover process(es); removed {root}; "
                             f"still alive: {left or 'none'}")
        log(result["cleanup"])
    result["load_end"] = cpu_load()
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(result, indent=2) if ns.json else report(result))
    return rc


if __name__ == "__main__":
    sys.exit(main())
