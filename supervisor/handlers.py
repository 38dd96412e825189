"""Request handlers of the supervisor's socket: one table, one authorization class per verb.

Who may call what is decided per request from the kernel's credentials of the connecting peer
(SO_PEERCRED at connect time: the door's, or ZeroMQ's ``Peer-Address`` on the agent's socket),
never from anything in the message:

- ``ANY`` local user: ``hello``, ``state``
- ``OWNER``: the job's owner, root and the agent's uid (``info``, ``pids``, ``stats``,
  ``output``, ``events``, ``signal``, ``pmi``)
- ``AGENT``: root and the agent's uid only (``claim``, ``wait``, ``ack``, ``abort``,
  ``terminate``, ``upgrade``): whoever may call these decides the step's fate

A refusal is an error reply "permission denied: ..." naming the verb; the server logs it with
the peer's uid and pid. A peer whose credentials are unknown gets only ``ANY`` verbs.

Control verbs name the (job, attempt) they mean; a request for any other attempt is refused, so a
stale agent request can never claim or acknowledge a relaunch.
"""

from __future__ import annotations

import logging
import os
import signal as _signal
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import tether
from tether.shared import protocol
from tether.shared.door import Conn
from tether.shared.errors import BadRequest, PermissionDenied, StateError, UnknownKind
from tether.shared.protocol import arg_int, arg_number, arg_str, check_known
from tether.shared.wire import Peer as WirePeer
from tether.supervisor import introspect
from tether.supervisor.step import Phase, signal_name

if TYPE_CHECKING:
    from tether.supervisor.service import Supervisor
    from tether.supervisor.state import SupervisorState

log = logging.getLogger("tether.supervisor")

#: Returned by a handler that will answer later (a long poll).
PENDING = object()

STREAMS = ("stdout", "stderr")
#: Largest byte offset a follower may name (files are never that big; msgpack ints are 64-bit).
MAX_OFFSET = 1 << 62
#: Most events in one ``events`` reply; the follower asks again for the rest.
EVENTS_MAX = 1000
#: ``output`` without ``offset``: the last this many lines, unless ``lines`` says otherwise.
DEFAULT_LINES = 10
MAX_LINES = 1_000_000
MAX_HOLD_ARG = 3600.0
ENDED = (Phase.EXITED, Phase.ABORTED)

#: who sent a request: the agent on the ZeroMQ socket in ctl/, or anyone on the door
Peer = WirePeer | Conn
Handler = Callable[["Supervisor", Peer, protocol.Request], Any]


ANY, OWNER, AGENT = "any", "owner", "agent"

#: The class of every verb. A verb missing here is refused to everyone but root and the agent.
VERB_CLASS: dict[str, str] = {
    "hello": ANY, "state": ANY,
    "info": OWNER, "pids": OWNER, "stats": OWNER, "output": OWNER, "events": OWNER,
    "signal": OWNER, "pmi": OWNER,
    "claim": AGENT, "wait": AGENT, "ack": AGENT, "abort": AGENT, "terminate": AGENT,
    "upgrade": AGENT,
}

_WHO = {OWNER: "the job's owner, root and the agent", AGENT: "root and the agent"}


def authorize(sup: Supervisor, peer: Peer, kind: str) -> None:
    cls = VERB_CLASS.get(kind, AGENT)
    if cls == ANY:
        return
    privileged = {0, os.getuid(), int(sup.spec["agent_uid"])}
    if peer.uid in privileged and peer.uid >= 0:
        return
    if cls == OWNER and peer.uid == sup.owner_uid and peer.uid >= 0:
        return
    raise PermissionDenied(f"permission denied: {kind!r} is for {_WHO[cls]} only "
                           f"(you are uid {peer.uid})")


def _control(sup: Supervisor, peer: Peer, req: protocol.Request) -> None:
    job = arg_int(req.args, "job")
    attempt = arg_int(req.args, "attempt")
    if (job, attempt) != (sup.rd.job, sup.rd.attempt):
        raise StateError(f"this supervisor runs job {sup.rd.job} attempt {sup.rd.attempt}, "
                         f"not job {job} attempt {attempt}")


def hello(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("versions",))
    version = protocol.negotiate(req.args.get("versions"))
    assert sup.ident is not None
    return {
        "role": "supervisor", "protocol": version, "version": tether.__version__,
        "job": sup.rd.job, "attempt": sup.rd.attempt, "phase": sup.step.phase.value,
        "pid": sup.ident.pid, "start_ticks": sup.ident.start_ticks,
        "boot_id": sup.ident.boot_id, "uid": os.getuid(), "generation": sup.generation,
        "cpus": sup.spec["cpus"], "gpus": sup.spec["gpus"], "memory_mb": sup.spec["memory_mb"],
    }


def state(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ())
    step = sup.step
    state = step.job_state()
    if state == "running" and sup.cgroup.active and sup.cgroup.frozen():
        state = "suspended"  # frozen by the agent (tether suspend): what the job object says
    return {
        "job": sup.rd.job, "attempt": sup.rd.attempt, "state": state,
        "phase": step.phase.value, "supervisor_pid": os.getpid(),
        "pids": step.live_pids(), "started_at": step.started_at, "ended_at": step.ended_at,
        "exit": sup.record,
    }


def claim(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job", "attempt"))
    _control(sup, peer, req)
    phase = sup.step.phase
    if phase is Phase.ABORTED:
        raise StateError(f"step {sup.rd.job}.{sup.rd.attempt} was aborted before launch: "
                         f"{sup.step.abort_reason}")
    if phase is Phase.READY:
        sup.claim(peer, req.id)  # answered once the outputs are open and the tasks started
        return PENDING
    return claim_result(sup)


def claim_result(sup: SupervisorState) -> dict[str, Any]:
    return {
        "phase": sup.step.phase.value, "started_at": sup.step.started_at,
        "tasks": [{"rank": t.rank, "pid": t.pid, "start_ticks": t.start_ticks}
                  for t in sup.step.tasks],
    }


def wait(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job", "attempt", "hold"))
    _control(sup, peer, req)
    hold = arg_number(req.args, "hold", default=30.0, maximum=3600.0)
    if sup.record is not None and sup.step.phase in (Phase.EXITED, Phase.ABORTED):
        return {"done": True, "record": sup.record}
    sup.add_waiter(peer, req.id, hold)
    return PENDING


def ack(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job", "attempt"))
    _control(sup, peer, req)
    if sup.step.phase not in (Phase.EXITED, Phase.ABORTED):
        raise StateError(f"step {sup.rd.job}.{sup.rd.attempt} has not ended "
                         f"(it is {sup.step.phase.value}); nothing to acknowledge")
    sup.acknowledged()
    return {}


def abort(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job", "attempt", "cancel"))
    _control(sup, peer, req)
    if sup.step.phase is Phase.READY:
        sup.abort("aborted by the agent", cancel=bool(req.args.get("cancel")), keep_record=False)
        return {"aborted": True}
    if sup.step.phase is Phase.ABORTED:
        return {"aborted": True}
    raise StateError(f"step {sup.rd.job}.{sup.rd.attempt} has already started")


def terminate(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job", "attempt", "grace", "cancel"))
    _control(sup, peer, req)
    grace = arg_number(req.args, "grace", default=10.0, maximum=86400.0)
    cancel = bool(req.args.get("cancel", False))
    sup.terminate(grace=grace, cancel=cancel,
                  why="cancelled" if cancel else "terminated by the agent")
    return {"phase": sup.step.phase.value}


def upgrade(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
    """Re-exec into the installed tether once this reply is out (service.reexec)."""
    check_known(req.args, req.kind, ())
    target = sup.request_upgrade()
    return {"pid": os.getpid(), "from": tether.__version__, "to": target,
            "generation": sup.generation + 1}


def pmi(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ())
    if sup.pmi is None:
        raise StateError(f"step {sup.rd.job}.{sup.rd.attempt} was not started with PMI")
    snap = sup.pmi.snapshot()
    snap["kind"] = sup.spec.get("pmi")
    return snap

# ---- introspection ---------------------------------------------------------------------------


def info(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
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


def _step_processes(sup: Supervisor,
                    procs: list[introspect.ProcSample]) -> introspect.StepProcesses:
    leaders = {t.pid: t.rank for t in sup.step.tasks if t.pid and not t.done}
    return introspect.step_processes(procs, os.getpid(), sup.session, leaders)


def pids(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
    """Answered from a /proc scan made off the loop (``Supervisor.after_scan``)."""
    check_known(req.args, req.kind, ())
    sup.after_scan(peer, req.id, lambda procs: pids_result(sup, procs))
    return PENDING


def pids_result(sup: Supervisor, scanned: list[introspect.ProcSample]) -> Any:
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


def stats(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
    """Answered from a /proc scan made off the loop (``Supervisor.after_scan``)."""
    check_known(req.args, req.kind, ())
    sup.after_scan(peer, req.id, lambda procs: stats_result(sup, procs))
    return PENDING


def stats_result(sup: Supervisor, procs: list[introspect.ProcSample]) -> Any:
    found = _step_processes(sup, procs)
    now = introspect.boottime()
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


def _selected(sup: Supervisor, which: str) -> tuple[str, ...]:
    """The streams a request names; ``both`` is one stream when both go to one file."""
    if which == "both":
        return ("stdout",) if sup.spec["output"] == sup.spec["error"] else STREAMS
    return (which,)


def _reader(sup: SupervisorState, name: str) -> int | None:
    fd = sup.launcher.readers.get(name)
    if fd is None and sup.step.phase not in (Phase.READY, Phase.ABORTED) and (
            any(t.pid for t in sup.step.tasks)):
        raise StateError(f"the {name} of step {sup.rd.job}.{sup.rd.attempt} cannot be read "
                         "(the supervisor could not open it at launch)")
    return fd


def stream_sizes(sup: SupervisorState) -> dict[str, int]:
    sizes = {}
    for name in STREAMS:
        fd = sup.launcher.readers.get(name)
        sizes[name] = introspect.fd_size(fd) if fd is not None else 0
    return sizes


def follow_result(sup: SupervisorState, streams: tuple[str, ...],
                  offsets: Mapping[str, int]) -> dict[str, Any]:
    """New bytes of each stream from its offset (at most FOLLOW_MAX each), and ``ended``."""
    res: dict[str, Any] = {"phase": sup.step.phase.value}
    complete = True
    final = sup.final_sizes or {}
    for name in streams:
        fd = _reader(sup, name)
        off = offsets.get(name, 0)
        size = introspect.fd_size(fd) if fd is not None else 0
        if off > size:
            raise BadRequest(f"offset {off} is past the end of {name} ({size} bytes)")
        data = b""
        if fd is not None and off < size:
            data = introspect.read_span(introspect.fd_reader(fd), off, size,
                                        introspect.FOLLOW_MAX)
        res[name] = {"data": data, "offset": off + len(data), "size": size}
        if off + len(data) < final.get(name, 0):
            complete = False
    res["ended"] = sup.step.phase in ENDED and sup.final_sizes is not None and complete
    return res


def has_news(res: Mapping[str, Any]) -> bool:
    return bool(res["ended"]) or any(
        res[name]["data"] for name in STREAMS if name in res)


def _offsets(value: Any, streams: tuple[str, ...]) -> dict[str, int]:
    if not isinstance(value, dict):
        raise BadRequest("argument 'offset' must be a map of stream name to byte offset")
    offsets = {}
    for name in value:
        if name not in streams:
            raise BadRequest(f"argument 'offset' names {name!r}, which is not one of the "
                             f"streams asked for ({', '.join(streams)})")
        offsets[name] = arg_int(value, name, minimum=0, maximum=MAX_OFFSET)
    return offsets


def output(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("stream", "lines", "offset", "hold"))
    which = arg_str(req.args, "stream", default="both")
    if which not in (*STREAMS, "both"):
        raise BadRequest(f"argument 'stream' must be stdout, stderr or both, not {which!r}")
    streams = _selected(sup, which)
    if "offset" in req.args:
        if "lines" in req.args:
            raise BadRequest("'lines' (the last lines) and 'offset' (follow) exclude each other")
        offsets = _offsets(req.args["offset"], streams)
        hold = arg_number(req.args, "hold", default=0.0, maximum=MAX_HOLD_ARG)
        res = follow_result(sup, streams, offsets)
        if hold > 0 and not has_news(res):
            sup.add_follower(peer, req.id, streams, offsets, hold)
            return PENDING
        sup.note_stream(peer, "output", bool(res["ended"]))
        return res
    if "hold" in req.args:
        raise BadRequest("'hold' needs 'offset' (follow mode)")
    lines = arg_int(req.args, "lines", default=DEFAULT_LINES, minimum=0, maximum=MAX_LINES)
    res = {"phase": sup.step.phase.value}
    for name in streams:
        fd = _reader(sup, name)
        if fd is None:
            res[name] = {"data": b"", "offset": 0, "size": 0, "truncated": False}
            continue
        read = introspect.fd_reader(fd)
        size = introspect.fd_size(fd)
        start, truncated = introspect.tail_start(read, size, lines)
        data = introspect.read_span(read, start, size, introspect.TAIL_MAX)
        res[name] = {"data": data, "offset": start, "size": size, "truncated": truncated}
    return res


def events_result(sup: SupervisorState, after: int) -> dict[str, Any]:
    batch = sup.events[after:after + EVENTS_MAX]
    last = after + len(batch)
    return {"events": batch, "last": last,
            "ended": sup.step.phase in ENDED and last == len(sup.events)}


def events(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("after", "hold"))
    after = arg_int(req.args, "after", default=0, minimum=0, maximum=MAX_OFFSET)
    if after > len(sup.events):
        raise BadRequest(f"argument 'after' is {after}, past the last event "
                         f"({len(sup.events)})")
    hold = arg_number(req.args, "hold", default=0.0, maximum=MAX_HOLD_ARG)
    res = events_result(sup, after)
    if hold > 0 and not res["events"] and not res["ended"]:
        sup.add_event_waiter(peer, req.id, after, hold)
        return PENDING
    sup.note_stream(peer, "events", bool(res["ended"]))
    return res


def signal(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("signal", "rank"))
    num = arg_int(req.args, "signal")
    if num not in {int(s) for s in _signal.valid_signals()}:
        raise BadRequest(f"{num} is not a valid signal number")
    rank = None
    if req.args.get("rank") is not None:
        rank = arg_int(req.args, "rank", minimum=0)
        if rank >= len(sup.step.tasks):
            raise BadRequest(f"no rank {rank}: step {sup.rd.job}.{sup.rd.attempt} has "
                             f"{len(sup.step.tasks)} task(s), ranks 0 to "
                             f"{len(sup.step.tasks) - 1}")
    if sup.step.phase is not Phase.RUNNING:
        raise StateError(f"step {sup.rd.job}.{sup.rd.attempt} is not running (it is "
                         f"{sup.step.phase.value}): nothing to signal")
    tasks = [t for t in sup.step.tasks if rank is None or t.rank == rank]
    live = [t for t in tasks if t.pid and not t.done]
    if not live:
        raise StateError(f"task {rank} of step {sup.rd.job}.{sup.rd.attempt} has already "
                         "exited" if rank is not None else
                         f"no task of step {sup.rd.job}.{sup.rd.attempt} is alive")
    sent = []
    for t in live:
        # an unreaped leader keeps its group id ours (the reaper runs before any request)
        try:
            os.killpg(t.pid, num)
        except ProcessLookupError:
            continue
        except PermissionError as exc:
            raise StateError(f"cannot signal task {t.rank}: {exc.strerror}") from None
        sent.append(t.rank)
    log.info("sent %s to rank(s) %s at the request of %s", signal_name(num), sent, peer)
    return {"signal": num, "name": signal_name(num), "ranks": sent}


HANDLERS: dict[str, Handler] = {
    "info": info,
    "pids": pids,
    "stats": stats,
    "output": output,
    "events": events,
    "signal": signal,
    "pmi": pmi,
    "hello": hello,
    "state": state,
    "claim": claim,
    "wait": wait,
    "ack": ack,
    "abort": abort,
    "terminate": terminate,
    "upgrade": upgrade,
}


def dispatch(sup: Supervisor, peer: Peer, req: protocol.Request) -> Any:
    handler = HANDLERS.get(req.kind)
    if handler is None:
        raise UnknownKind(f"unknown request kind {req.kind!r}")
    protocol.check_kind_version(req)
    authorize(sup, peer, req.kind)
    return handler(sup, peer, req)
