"""A job as the agent holds it (``Job``, the scheduler's ``Queued``, the states) and how it
maps onto the database's tables: which table keeps which field, the one query every read goes
through, and a row of it back into a Job (pure: no I/O).

Apart from the Store (db.py), which runs the statements, so that everything the rest of the
agent imports to hold a job needs no database, and the layout of a row is in one place.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from tether.agent.ledger import Allocation
from tether.shared import jobstates, stamps

#: the states are shared/jobstates.py's, one table for a node and the cluster; a node's own
#: jobs end in a step's result (``node_fail`` is the cluster's word for a lost node's job)
ACTIVE = jobstates.ACTIVE
FINAL = jobstates.RESULTS
STATES = ("pending", *ACTIVE, *FINAL)


@dataclass
class Job:
    id: int
    name: str
    command: list[str]
    state: str
    attempt: int
    exit_code: int | None
    signal: int | None
    reason: str | None
    cpus_per_task: int
    ntasks: int
    gpus_req: int
    memory_mb: int
    cpus: list[int]
    gpus: list[int]
    supervisor_pid: int | None
    supervisor_ticks: int | None
    pids: list[int]
    output: str
    error: str
    workdir: str
    env: dict[str, str] = field(repr=False)
    submitted_at: str
    started_at: str | None
    ended_at: str | None
    cancel_requested: bool
    pmi: str = "none"
    user: str | None = None
    uid: int | None = None
    gid: int | None = None
    #: the supervisor's boot id and session, recorded before it is claimed (tasks start in that
    #: session): with supervisor_ticks, how a lost step is found when its manifest is unusable
    supervisor_boot: str | None = None
    supervisor_session: int | None = None
    core_dumped: bool = False
    #: seconds the step may run (the supervisor enforces it), None: no limit
    time_limit: float | None = None
    #: held by its user (``submit --hold``, ``tether hold``): not started until released
    held: bool = False
    #: (kind, job id) pairs that must all be satisfied before it starts
    dependency: list[tuple[str, int]] = field(default_factory=list)
    #: an element of an array: the array's id (its first element's), its index, its %MAX
    array_id: int | None = None
    array_index: int | None = None
    array_max: int | None = None
    #: epoch seconds before which it may not start (``submit --begin``), None: at once
    begin_at: float | None = None
    #: why a pending job waits (computed by the scheduler, never stored)
    pending_reason: str | None = None
    #: the OOM killer took a process of the step (its memory limit was exceeded)
    oom: bool = False
    #: wall-clock time (epoch seconds) the job was suspended, while it is
    suspended_at: float | None = None
    #: seconds spent suspended before (not counting the current suspension)
    suspended_seconds: float = 0.0
    #: a --pmi job whose ranks all ended without a word of PMI (each ran alone, as 0 of 1)
    pmi_unused: bool = False

    @property
    def suspended(self) -> bool:
        return self.suspended_at is not None and self.state == "running"

    def suspended_total(self, now: float) -> float:
        """Seconds suspended in all, the current suspension included."""
        extra = max(0.0, now - self.suspended_at) if self.suspended_at is not None else 0.0
        return round(self.suspended_seconds + extra, 3)

    @property
    def allocation(self) -> Allocation:
        return Allocation(tuple(self.cpus), tuple(self.gpus), self.memory_mb)

    @property
    def final(self) -> bool:
        return self.state in FINAL

    def public(self) -> dict[str, Any]:
        """The job object of the CLI contract."""
        out: dict[str, Any] = {
            "id": self.id, "name": self.name, "command": self.command, "state": self.state,
            "attempt": self.attempt, "exit_code": self.exit_code, "signal": self.signal,
            "reason": self.reason, "cpus": self.cpus, "gpus": self.gpus,
            "memory_mb": self.memory_mb, "ntasks": self.ntasks,
            "cpus_per_task": self.cpus_per_task, "supervisor_pid": self.supervisor_pid,
            "pids": self.pids, "output": self.output, "error": self.error,
            "workdir": self.workdir, "submitted_at": self.submitted_at,
            "started_at": self.started_at, "ended_at": self.ended_at, "pmi": self.pmi,
            "user": self.user, "uid": self.uid, "core_dumped": self.core_dumped,
            "time_limit": self.time_limit, "held": self.held,
            # Slurm's spellings: a whole array as ID_*, singleton alone (request_args.py)
            "dependency": [k if k == "singleton" else f"{k}:{-j}_*" if j < 0 else f"{k}:{j}"
                           for k, j in self.dependency],
            "array_id": self.array_id, "array_index": self.array_index,
            "array_max": self.array_max,
            # "suspended" is a state of the job object only: the row says running (schema.py)
            "oom": self.oom, **({"state": "suspended"} if self.suspended else {}),
            "suspended_seconds": self.suspended_total(time.time()),
            "begin_at": None if self.begin_at is None else stamps.stamp(self.begin_at),
            "pmi_unused": self.pmi_unused,
        }
        if self.state == "pending" and self.pending_reason is not None:
            out["reason"] = self.pending_reason  # Slurm's pending reason, as squeue shows it
        return out


@dataclass(frozen=True, slots=True)
class Queued:
    """A pending job as the scheduler sees it (``Store.queue``)."""

    id: int
    cpus: int
    gpus: int
    memory_mb: int
    time_limit: float | None
    held: bool
    dependency: list[tuple[str, int]]
    array_id: int | None
    array_max: int | None
    begin_at: float | None = None


# ---- the table map: where each field of a Job is kept, and how a row is read ----------------

#: the fields of Job kept in job_facts rather than jobs
FACTS = ("supervisor_boot", "supervisor_session", "core_dumped", "pmi_unused")
#: the fields of Job kept in job_sched
SCHED = ("time_limit", "held", "dependency", "array_id", "array_index", "array_max",
         "begin_at")
#: the fields of Job kept in job_cgroup
CGROUP = ("oom", "suspended_at", "suspended_seconds")
#: the columns of ``jobs`` a Job is read from, in the order ``from_row`` takes them
JOBS_COLUMNS = ("id", "name", "command", "state", "attempt", "exit_code", "signal", "reason",
                "cpus_per_task", "ntasks", "gpus_req", "memory_mb", "cpus", "gpus",
                "supervisor_pid", "supervisor_ticks", "pids", "output", "error", "workdir",
                "env", "submitted_at", "started_at", "ended_at", "cancel_requested", "pmi",
                "user", "uid", "gid")
#: every query reads jobs through this: job_facts' identity counts only while it is of the
#: supervisor the jobs row names (an agent rolled back to 0.1.0 updates jobs alone)
SELECT = ("SELECT " + ", ".join(f"jobs.{c}" for c in JOBS_COLUMNS) + ", "
          "f.supervisor_ticks, f.supervisor_boot, f.supervisor_session, "
          "COALESCE(f.core_dumped, 0), s.time_limit, COALESCE(s.held, 0), s.dependency, "
          "s.array_id, s.array_index, s.array_max, s.begin_at, COALESCE(cg.oom, 0), "
          "cg.suspended_at, COALESCE(cg.suspended_seconds, 0), COALESCE(f.pmi_unused, 0) "
          "FROM jobs LEFT JOIN job_facts f ON f.job = jobs.id "
          "LEFT JOIN job_sched s ON s.id = jobs.id "
          "LEFT JOIN job_cgroup cg ON cg.job = jobs.id")
#: the fields of Job kept as JSON text
JSON_COLS = ("command", "cpus", "gpus", "pids", "env")
#: columns stored as integers that a Job holds as bools
BOOLS = ("cancel_requested", "core_dumped", "held", "oom", "pmi_unused")
#: the supervisor's identity: written together (job_facts keeps boot and session only with
#: the ticks they belong to)
IDENTITY = frozenset({"supervisor_ticks", "supervisor_boot", "supervisor_session"})


def _list(text: str) -> Any:
    return [] if text == "[]" else json.loads(text)


def from_row(row: tuple[Any, ...]) -> Job:
    """A row of ``SELECT`` as a Job: by position (the loop reads a few rows per job)."""
    (job_id, name, command, state, attempt, exit_code, signal, reason, cpus_per_task, ntasks,
     gpus_req, memory_mb, cpus, gpus, supervisor_pid, supervisor_ticks, pids, output, error,
     workdir, env, submitted_at, started_at, ended_at, cancel_requested, pmi, user, uid, gid,
     facts_ticks, supervisor_boot, supervisor_session, core_dumped, time_limit, held,
     dependency, array_id, array_index, array_max, begin_at, oom, suspended_at,
     suspended_seconds, pmi_unused) = row
    if facts_ticks != supervisor_ticks:
        supervisor_boot = supervisor_session = None
    return Job(job_id, name, json.loads(command), state, attempt, exit_code, signal, reason,
               cpus_per_task, ntasks, gpus_req, memory_mb, _list(cpus), _list(gpus),
               supervisor_pid, supervisor_ticks, _list(pids), output, error, workdir,
               json.loads(env), submitted_at, started_at, ended_at, bool(cancel_requested),
               pmi, user, uid, gid, supervisor_boot, supervisor_session, bool(core_dumped),
               time_limit, bool(held),
               [tuple(x) for x in json.loads(dependency)] if dependency else [],
               array_id, array_index, array_max, begin_at, None, bool(oom), suspended_at,
               suspended_seconds, bool(pmi_unused))
