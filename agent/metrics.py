"""The node's and its jobs' figures for Prometheus, as a node_exporter textfile (``agent
--metrics-file PATH``, every ``--metrics-interval`` seconds): no listener, no client library.

node_exporter's textfile collector reads every ``*.prom`` file of its directory at each scrape;
a file must be replaced whole (a half-written one is read as it is), so each one is written
beside the target and renamed over it. What the agent knows (its ledger, its database, the
running jobs) is taken on the loop, where it is consistent and cheap; reading each running
step's cgroup and writing the file may block (a slow file system, a kernel busy with cgroups),
so both happen on a thread of their own, which the loop never waits for: a write still going
when the next is due is simply replaced by the newer figures.

Agent starts are counted in ``STATE_DIR/agent.starts`` (a number, replaced at each start), so
that ``tether_agent_starts_total`` counts restarts across the agent's life, crashes included.
On a clean stop the file is written once more with ``tether_agent_up 0`` and no job figures; a
file whose ``tether_agent_up`` stays 1 while node_exporter's ``node_textfile_mtime_seconds`` for
it falls behind belongs to an agent that died. docs/operations.md lists every metric.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import tether
from tether.shared import stamps

if TYPE_CHECKING:
    from tether.agent.view import MetricsAgent as Agent
    from tether.shared.timers import Timer

log = logging.getLogger("tether.agent")

#: (name, type, help) of every metric, in the file's order
METRICS: list[tuple[str, str, str]] = [
    ("tether_agent_up", "gauge", "1 while the agent runs; 0 written as it stops cleanly"),
    ("tether_agent_info", "gauge", "the agent's node and release, as labels"),
    ("tether_agent_start_time_seconds", "gauge", "when this agent started (Unix time)"),
    ("tether_agent_starts_total", "counter",
     "agent starts on this state directory (restarts: its increase)"),
    ("tether_agent_reattach_seconds", "gauge", "from this agent's start until every step "
     "supervisor found running had answered (0: none was)"),
    ("tether_jobs", "gauge", "jobs of the agent's database, by state"),
    ("tether_queue_length", "gauge", "pending jobs"),
    ("tether_cpus_total", "gauge", "CPUs the agent hands out"),
    ("tether_cpus_allocated", "gauge", "CPUs held by jobs"),
    ("tether_gpus_total", "gauge", "GPUs the agent hands out"),
    ("tether_gpus_allocated", "gauge", "GPUs held by jobs"),
    ("tether_memory_total_bytes", "gauge", "memory the agent hands out"),
    ("tether_memory_allocated_bytes", "gauge", "memory held by jobs"),
    ("tether_job_cpus", "gauge", "CPUs allocated to a running job"),
    ("tether_job_gpus", "gauge", "GPUs allocated to a running job"),
    ("tether_job_memory_allocated_bytes", "gauge", "memory allocated to a running job (0: none "
     "asked)"),
    ("tether_job_start_time_seconds", "gauge", "when a running job's tasks started"),
    ("tether_job_cpu_seconds_total", "counter", "CPU time of a running job's step, from its "
     "cgroup"),
    ("tether_job_memory_bytes", "gauge", "memory of a running job's step now, from its cgroup"),
    ("tether_job_memory_peak_bytes", "gauge", "the most memory a running job's step has used, "
     "from its cgroup"),
]

MIB = 1024 * 1024


@dataclass
class RunningJob:
    labels: dict[str, str]
    job: int
    attempt: int
    cpus: int
    gpus: int
    memory_mb: int
    started: float | None


@dataclass
class Snapshot:
    """What the loop knows, taken at once; the thread adds each job's cgroup figures."""

    up: int
    info: dict[str, str]
    values: dict[str, float | None]
    jobs_by_state: dict[str, int]
    running: list[RunningJob] = field(default_factory=list)


class Metrics:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.timer: Timer | None = None
        self.started = time.time()
        self.starts = 0
        self.lock = threading.Condition()
        self.pending: Snapshot | None = None
        #: files of an earlier --metrics-file, removed by the thread (a reload changed it)
        self.retired: list[str] = []
        #: the file being written to now
        self.path: str | None = None
        self.thread: threading.Thread | None = None
        self.closed = False
        #: the last write's error, said once until a write succeeds again
        self.failing: str | None = None

    # ---- on the loop -----------------------------------------------------------------------

    def start(self) -> None:
        """The agent serves: count this start, and write from now on if asked to."""
        self.starts = _count_start(os.path.join(self.agent.cfg.state_dir, "agent.starts"))
        self.configure()

    def configure(self) -> None:
        """(Re)arm the next write from the settings (at start and at each reload); a file the
        settings no longer name is removed: its figures would stay, and look live."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        path = self.agent.cfg.service.metrics_file
        if self.path is not None and self.path != path:
            with self.lock:
                self.retired.append(self.path)
                self.lock.notify()
            self._thread()
        self.path = path
        if path and not self.closed:
            self.timer = self.agent.timers.at(time.monotonic(), self.tick)

    def tick(self) -> None:
        svc = self.agent.cfg.service
        self.timer = self.agent.timers.at(time.monotonic() + svc.metrics_interval, self.tick)
        try:
            snap = self.snapshot(up=1)
        except Exception:  # the node's figures must never stop its work
            log.exception("metrics: gathering the figures failed")
            return
        with self.lock:
            self.pending = snap
            self.lock.notify()
        self._thread()

    def _thread(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="tether-metrics",
                                           daemon=True)
            self.thread.start()

    def snapshot(self, up: int) -> Snapshot:
        agent = self.agent
        counts = dict(agent.db.counts())
        running: list[RunningJob] = []
        if up:
            suspended = 0
            for job in agent.db.in_states("running"):
                suspended += job.suspended_at is not None
                ref = str(job.id) if job.array_id is None else f"{job.array_id}_{job.array_index}"
                running.append(RunningJob(
                    {"job_id": ref, "name": job.name, "user": job.user or ""}, job.id,
                    job.attempt, len(job.cpus), len(job.gpus), job.memory_mb,
                    stamps.epoch(job.started_at) if job.started_at else None))
            counts["running"] = counts.get("running", 0) - suspended
            counts["suspended"] = suspended
        usage = agent.ledger.usage()
        reattach = agent.reattach_seconds
        values: dict[str, float | None] = {
            "tether_agent_up": up, "tether_agent_info": 1,
            "tether_agent_start_time_seconds": self.started,
            "tether_agent_starts_total": self.starts,
            "tether_agent_reattach_seconds": 0.0 if reattach is None and agent.reattach_t0
            is None else reattach,
            "tether_queue_length": counts.get("pending", 0)}
        for res, scale in (("cpus", 1), ("gpus", 1), ("memory", MIB)):
            figures = usage["memory_mb" if res == "memory" else res]
            unit = "_bytes" if res == "memory" else ""
            values[f"tether_{res}_total{unit}"] = figures["total"] * scale
            values[f"tether_{res}_allocated{unit}"] = figures["allocated"] * scale
        return Snapshot(up, {"node": agent.cfg.node, "version": tether.__version__}, values,
                        counts, running)

    def close(self) -> None:
        """The agent stops: no more writes; the last one says it is down."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        with self.lock:
            self.closed = True
            self.pending = None
            self.lock.notify()
        if self.thread is not None:
            self.thread.join(timeout=10)
        path = self.path
        if path and self.agent.store is not None:
            with contextlib.suppress(Exception):
                self.write(path, self.snapshot(up=0), lambda job, attempt: None)

    # ---- on the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self.lock:
                while self.pending is None and not self.retired and not self.closed:
                    self.lock.wait()
                if self.closed:
                    return
                snap, self.pending = self.pending, None
                retired, self.retired = self.retired, []
                path = self.path
            for old in retired:
                with contextlib.suppress(OSError):
                    os.unlink(old)
            if path and snap is not None:
                self.write(path, snap, self.agent.contain.stats)

    def write(self, path: str, snap: Snapshot,
              stats: Callable[[int, int], dict[str, Any] | None]) -> None:
        try:
            text = render(snap, stats)
            tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                         0o644)
            try:
                os.write(fd, text.encode("utf-8", "backslashreplace"))
                os.fchmod(fd, 0o644)  # node_exporter runs as another user
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            if str(exc) != self.failing:
                log.warning("metrics: cannot write %s: %s", path, exc)
            self.failing = str(exc)
            return
        if self.failing is not None:
            log.info("metrics: %s written again", path)
            self.failing = None


def render(snap: Snapshot, stats: Callable[[int, int], dict[str, Any] | None]) -> str:
    """The Prometheus text exposition format (0.0.4) of ``snap``, with each running job's
    cgroup figures read now (``stats``: ``Containment.stats``; None without a cgroup)."""
    samples: dict[str, list[tuple[dict[str, str], float | None]]] = {m: [] for m, _, _ in METRICS}
    for name, value in snap.values.items():
        samples[name].append((snap.info if name == "tether_agent_info" else {}, value))
    for state, n in sorted(snap.jobs_by_state.items()):
        samples["tether_jobs"].append(({"state": state}, n))
    for job in snap.running:
        samples["tether_job_cpus"].append((job.labels, job.cpus))
        samples["tether_job_gpus"].append((job.labels, job.gpus))
        samples["tether_job_memory_allocated_bytes"].append((job.labels, job.memory_mb * MIB))
        samples["tether_job_start_time_seconds"].append((job.labels, job.started))
        try:
            cg = stats(job.job, job.attempt)
        except Exception:  # a step ending as it is read: its figures are simply left out
            cg = None
        if cg is not None:
            samples["tether_job_cpu_seconds_total"].append((job.labels, cg.get("cpu_seconds")))
            samples["tether_job_memory_bytes"].append((job.labels, cg.get("memory_current")))
            samples["tether_job_memory_peak_bytes"].append((job.labels, cg.get("memory_peak")))
    lines = []
    for name, kind, help_text in METRICS:
        present = [(labels, v) for labels, v in samples[name] if v is not None]
        if not present:
            continue
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for labels, value in present:
            lines.append(f"{name}{_labels(labels)} {_number(value)}")
    return "\n".join(lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    escaped = (f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + ",".join(escaped) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value) if isinstance(value, float) else str(int(value))


def _count_start(path: str) -> int:
    """This start's number: the count in ``path`` plus one, written back whole (a damaged or
    missing file counts from 0)."""
    try:
        with open(path) as f:
            count = int(f.read().strip() or 0)
    except (OSError, ValueError):
        count = 0
    count += 1
    tmp = f"{path}.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(f"{count}\n")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot count this start in %s: %s", path, exc)
    return count
