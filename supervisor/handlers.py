"""Request handlers of the supervisor's socket: one table, one authorization class per verb,
and the verbs that act on the step (``claim``, ``wait``, ``ack``, ``abort``, ``terminate``,
``upgrade``, ``signal``) or say who it is (``hello``, ``state``). The verbs that only read it are
in handlers_inspect.py (``info``, ``pids``, ``stats``, ``pmi``) and handlers_output.py
(``output``, ``events``).

Who may call what is decided per request from the kernel's credentials of the connecting peer
(SO_PEERCRED at connect time, taken by whichever door the request came in by),
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
from collections.abc import Callable
from typing import Any

import tether
from tether.shared import protocol
from tether.shared.errors import BadRequest, PermissionDenied, StateError, UnknownKind
from tether.shared.protocol import arg_int, arg_number, check_known
from tether.supervisor import handlers_inspect, handlers_output
from tether.supervisor.machine_events import (
    AbortRequested,
    AckRequested,
    Act,
    ClaimRequested,
    TerminateRequested,
    UpgradeRequested,
    WaitFor,
)
from tether.supervisor.state import PENDING, Peer, SupervisorState
from tether.supervisor.step import Phase, signal_name

log = logging.getLogger("tether.supervisor")

#: a handler reads the supervisor (it never drives it) and returns the reply, or an ``Act``: the
#: events to feed (machine_events.py), then the reply
Handler = Callable[[SupervisorState, Peer, protocol.Request], Any]
View = SupervisorState


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


def authorize(sup: View, peer: Peer, kind: str) -> None:
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


def _control(sup: View, peer: Peer, req: protocol.Request) -> None:
    job = arg_int(req.args, "job")
    attempt = arg_int(req.args, "attempt")
    if (job, attempt) != (sup.rd.job, sup.rd.attempt):
        raise StateError(f"this supervisor runs job {sup.rd.job} attempt {sup.rd.attempt}, "
                         f"not job {job} attempt {attempt}")


def hello(sup: View, peer: Peer, req: protocol.Request) -> Any:
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


def state(sup: View, peer: Peer, req: protocol.Request) -> Any:
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


def claim(sup: View, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job", "attempt"))
    _control(sup, peer, req)
    phase = sup.step.phase
    if phase is Phase.ABORTED:
        raise StateError(f"step {sup.rd.job}.{sup.rd.attempt} was aborted before launch: "
                         f"{sup.step.abort_reason}")
    if phase is Phase.READY:
        # answered once the outputs are open and the tasks started
        return Act((ClaimRequested(peer=peer, rid=req.id),), PENDING)
    return claim_result(sup)


def claim_result(sup: View) -> dict[str, Any]:
    return {
        "phase": sup.step.phase.value, "started_at": sup.step.started_at,
        "tasks": [{"rank": t.rank, "pid": t.pid, "start_ticks": t.start_ticks}
                  for t in sup.step.tasks],
    }


def wait(sup: View, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job", "attempt", "hold"))
    _control(sup, peer, req)
    hold = arg_number(req.args, "hold", default=30.0, maximum=3600.0)
    if sup.record is not None and sup.step.phase in (Phase.EXITED, Phase.ABORTED):
        return {"done": True, "record": sup.record}
    return Act((WaitFor(peer=peer, rid=req.id, hold=hold),), PENDING)


def ack(sup: View, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job", "attempt"))
    _control(sup, peer, req)
    if sup.step.phase not in (Phase.EXITED, Phase.ABORTED):
        raise StateError(f"step {sup.rd.job}.{sup.rd.attempt} has not ended "
                         f"(it is {sup.step.phase.value}); nothing to acknowledge")
    return Act((AckRequested(),), {})


def abort(sup: View, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job", "attempt", "cancel"))
    _control(sup, peer, req)
    if sup.step.phase is Phase.READY:
        return Act((AbortRequested(reason="aborted by the agent",
                                   cancel=bool(req.args.get("cancel"))),), {"aborted": True})
    if sup.step.phase is Phase.ABORTED:
        return {"aborted": True}
    raise StateError(f"step {sup.rd.job}.{sup.rd.attempt} has already started")


def terminate(sup: View, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job", "attempt", "grace", "cancel"))
    _control(sup, peer, req)
    grace = arg_number(req.args, "grace", default=10.0, maximum=86400.0)
    cancel = bool(req.args.get("cancel", False))
    ev = TerminateRequested(grace=grace, cancel=cancel,
                            why="cancelled" if cancel else "terminated by the agent")
    return Act((ev,), lambda view: {"phase": view.step.phase.value})


def upgrade(sup: View, peer: Peer, req: protocol.Request) -> Any:
    """Re-exec into the installed tether once this reply is out (service.reexec)."""
    check_known(req.args, req.kind, ())
    return Act((UpgradeRequested(),), lambda view: {
        "pid": os.getpid(), "from": tether.__version__, "to": view.upgrade_target,
        "generation": view.generation + 1})


def signal(sup: View, peer: Peer, req: protocol.Request) -> Any:
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
    "info": handlers_inspect.info,
    "pids": handlers_inspect.pids,
    "stats": handlers_inspect.stats,
    "output": handlers_output.output,
    "events": handlers_output.events,
    "signal": signal,
    "pmi": handlers_inspect.pmi,
    "hello": hello,
    "state": state,
    "claim": claim,
    "wait": wait,
    "ack": ack,
    "abort": abort,
    "terminate": terminate,
    "upgrade": upgrade,
}


def dispatch(sup: View, peer: Peer, req: protocol.Request) -> Any:
    handler = HANDLERS.get(req.kind)
    if handler is None:
        raise UnknownKind(f"unknown request kind {req.kind!r}")
    protocol.check_kind_version(req)
    authorize(sup, peer, req.kind)
    return handler(sup, peer, req)
