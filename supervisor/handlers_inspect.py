"""The verbs that read a step's processes and PMI server for its owner: ``info``, ``pids``,
``stats`` and ``pmi`` (what ``tether inspect`` asks).

Why a module of its own: these verbs change nothing in the step; they read it, mostly through
introspect.py's /proc readers. ``pids`` and ``stats`` are answered from a /proc scan made off the
loop (the handler returns a ``ScanFor`` event, which effects.py carries out: it parks the
request) and ``pids_result`` or ``stats_result`` builds the reply once the scan is in. The
table, who may call each verb and the verbs that act on the step are in handlers.py.
"""

from __future__ import annotations

import os
from typing import Any

import tether
from tether.shared import protocol
from tether.shared.errors import StateError
from tether.shared.procid import boottime
from tether.shared.protocol import check_known
from tether.supervisor import introspect
from tether.supervisor.machine_events import Act, ScanFor
from tether.supervisor.state import PENDING, Peer, SupervisorState


def info(sup: SupervisorState, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ())
    spec = sup.spec
    return {
        "job": sup.rd.job, "attempt": sup.rd.attempt, "name": spec.get("name"),
        "command": spec["command"], "uid": sup.owner_uid,
        "user": spec["user"] if isinstance(spec.get("user"), str) else
        introspect.user_name(sup.owner_uid), "workdir": spec["workdir"],
        "ntasks": spec["ntasks"], "cpus": spec["cpus"], "gpus": spec["gpus"],
        "memory_mb": spec["memory_mb"], "output": spec["output"], "error": spec["error"],
        "pmi": spec.get("pmi", "none"), "version": tether.__version__,
        "protocol": protocol.PROTOCOL_VERSION, "supervisor_pid": os.getpid(),
        "state": sup.step.job_state(), "phase": sup.step.phase.value,
        "started_at": sup.step.started_at, "ended_at": sup.step.ended_at,
    }


def _task_status(t: Any) -> dict[str, Any]:
    return {"rank": t.rank, "pid": t.pid, "start_ticks": t.start_ticks,
            "alive": bool(t.pid) and not t.done, "exit_code": t.exit_code,
            "signal": t.signal, "reason": t.reason}


def _step_processes(sup: SupervisorState,
                    procs: list[introspect.ProcSample]) -> introspect.StepProcesses:
    leaders = {t.pid: t.rank for t in sup.step.tasks if t.pid and not t.done}
    return introspect.step_processes(procs, os.getpid(), sup.session, leaders)


def pids(sup: SupervisorState, peer: Peer, req: protocol.Request) -> Any:
    """Answered from a /proc scan made off the loop (``ScanFor``, carried out by effects.py)."""
    check_known(req.args, req.kind, ())
    return Act((ScanFor(peer=peer, rid=req.id, compute=lambda procs: pids_result(sup, procs)),),
               PENDING)


def pids_result(sup: SupervisorState, scanned: list[introspect.ProcSample]) -> Any:
    me = os.getpid()
    found = _step_processes(sup, scanned)
    leaders = {t.pid for t in sup.step.tasks if t.pid and not t.done}
    members = [p for group in found.by_rank.values() for p in group] + found.adopted
    procs = []
    for p in sorted(members, key=lambda p: p.pid):
        if p.pid in leaders:
            continue
        rank = found.owner[p.pid]
        procs.append({"pid": p.pid, "ppid": p.ppid, "pgrp": p.pgrp, "session": p.session,
                      "start_ticks": p.start_ticks, "state": p.state, "comm": p.comm,
                      "rank": rank, "adopted": rank is None and p.ppid == me})
    return {"tasks": [_task_status(t) for t in sup.step.tasks],
            "processes": procs[:introspect.MAX_PROCESSES],
            "truncated": len(procs) > introspect.MAX_PROCESSES,
            "supervisor_pid": me, "session": sup.session, "phase": sup.step.phase.value}


def stats(sup: SupervisorState, peer: Peer, req: protocol.Request) -> Any:
    """Answered from a /proc scan made off the loop (``ScanFor``, carried out by effects.py)."""
    check_known(req.args, req.kind, ())
    return Act((ScanFor(peer=peer, rid=req.id, compute=lambda procs: stats_result(sup, procs)),),
               PENDING)


def stats_result(sup: SupervisorState, procs: list[introspect.ProcSample]) -> Any:
    found = _step_processes(sup, procs)
    now = boottime()
    tasks = []
    for t in sup.step.tasks:
        entry: dict[str, Any] = {"rank": t.rank, "pid": t.pid, "alive": bool(t.pid) and not t.done}
        if t.pid and not t.done:
            group = found.by_rank.get(t.rank, [])  # memory read by the scan (snapshot)
            entry.update(introspect.usage(group), processes=len(group),
                         elapsed=introspect.elapsed(t.start_ticks, None, now))
        else:
            end = sup.task_end_boottime.get(t.rank)
            entry.update(cpu_user=round(t.utime, 3), cpu_system=round(t.stime, 3), rss_kb=0,
                         peak_rss_kb=t.maxrss_kb, processes=0,
                         elapsed=introspect.elapsed(t.start_ticks, end, now) if t.pid else 0.0)
        tasks.append(entry)
    adopted = found.adopted
    other = dict(introspect.usage(adopted), processes=len(adopted))
    parts = [*tasks, other]
    total = {
        "cpu_user": round(sum(float(p["cpu_user"]) for p in parts), 3),
        "cpu_system": round(sum(float(p["cpu_system"]) for p in parts), 3),
        "rss_kb": sum(int(p["rss_kb"]) for p in parts),
        "peak_rss_kb": sum(int(p["peak_rss_kb"]) for p in parts),
        "processes": sum(int(p["processes"]) for p in parts),
        "elapsed": max((float(t["elapsed"]) for t in tasks), default=0.0),
    }
    cg = sup.cgroup.stats() if sup.cgroup.active and sup.cgroup.exists() else None
    return {"tasks": tasks, "adopted": other, "total": total, "phase": sup.step.phase.value,
            "cgroup": cg}


def pmi(sup: SupervisorState, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ())
    if sup.pmi is None:
        raise StateError(f"step {sup.rd.job}.{sup.rd.attempt} was not started with PMI")
    snap = sup.pmi.snapshot()
    snap["kind"] = sup.spec.get("pmi")
    return snap
