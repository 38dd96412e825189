"""Feeding the lifecycle's events and performing its effects: the glue around agent/lifecycle.py.

What happens to a (job, attempt) is decided by ``lifecycle.py`` alone (a pure transition table);
this module hands it events (``feed``, one transition completing before the next) and performs
the effects it asks for (``perform``): the durable ones (record, finalize, release, requeue)
at once, every other one (spawn, hello, claim, wait, terminate, ack, kill, remove) held until
those writes are durable (group_commit.py ``hold``), in the machine's order. The steps (numbered
as in docs/architecture.md):
  pending -> [allocate, record ``starting`` + attempt + allocation] -> spawn -> hello -> claim
  -> [record ``running``] -> wait (long poll, re-issued) -> [record the result, free the
  allocation, answer waiters] -> ack -> the supervisor removes its run directory and exits.

A database write that fails for want of space leaves the machine as it was; the same event is
fed again ``RETRY_FULL`` seconds later, so results are recorded once space returns.

The functions take the agent and are bound as its methods (daemon.py ``Agent``).
"""

from __future__ import annotations

import functools
import logging
import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tether.agent import acct, fallback, lifecycle, lifecycle_effects, lifecycle_events
from tether.agent.db import StoreFull
from tether.agent.follow import RETRY_UNRESPONSIVE
from tether.agent.job import Job
from tether.shared.faults import agent_fault
from tether.shared.timers import rfc3339_now

if TYPE_CHECKING:
    from tether.agent.view import EffectsAgent as Agent

log = logging.getLogger("tether.agent")

#: after a database write failed for want of space, the event is fed again this much later
RETRY_FULL = 1.0


def feed(agent: Agent, job_id: int, attempt: int, event: lifecycle_events.Event) -> None:
    """Hand an event to the job's machine. Events that effects raise while this runs are
    queued and handled in order after it, so each transition completes before the next."""
    agent.events.append((job_id, attempt, event))
    if agent.feeding:
        return
    agent.feeding = True
    try:
        while agent.events:
            j, a, ev = agent.events.popleft()
            try:
                agent.apply(j, a, ev)
            except Exception:  # a bug in one job's handling must not stop the node
                log.exception("job %d: internal error while handling %r", j, ev)
    finally:
        agent.feeding = False


def apply(agent: Agent, job_id: int, attempt: int, event: lifecycle_events.Event) -> None:
    machine = agent.machines.get(job_id)
    if machine is None or machine.attempt != attempt:
        return  # a late event for an attempt that is settled and forgotten
    new, effects = lifecycle.step(machine, event)
    if new is machine and not effects:
        return
    log.debug("job %d: %r + %r -> %r: %r", job_id, machine, event, new, effects)
    if agent_fault(agent.cfg.faults, "skip-ack") and isinstance(event, lifecycle_events.ExitRecord):
        log.warning("job %d: fault injection: not acknowledging", job_id)
        effects = [e for e in effects if not isinstance(e, lifecycle_effects.Ack)]
    agent.machines[job_id] = new
    try:
        agent.perform(new, effects)
    except StoreFull as exc:
        # Durable effects come first, so nothing after the failed write was done: keep the
        # old machine and feed the same event again once there may be space.
        if agent.machines.get(job_id) is new:
            agent.machines[job_id] = machine
        log.error("job %d: %s; trying again in %gs", job_id, exc.message, RETRY_FULL)
        agent.timers.at(time.monotonic() + RETRY_FULL,
                       lambda: agent.feed(job_id, attempt, event))
        return
    if new.state not in (lifecycle.State.ADOPTING, lifecycle.State.CONNECTING,
                         lifecycle.State.CLAIMING):
        agent.reattaching.discard(job_id)
    if new.final and agent.machines.get(job_id) is new:
        del agent.machines[job_id]
        agent.idents.pop(job_id, None)
        link = agent.links.get(job_id)
        if link is not None:
            agent.drop_link(link)


def perform(agent: Agent, m: lifecycle.Machine, effects: list[lifecycle_effects.Effect]) -> None:
    """Durable effects (writes) and the ledger's now; every other one is held until the
    writes are durable (``hold``: the turn's single fsync), in the machine's order."""
    ended: Job | None = None  # as finalized (no write follows a Finalize in one transition)
    for eff in effects:
        if isinstance(eff, lifecycle_effects.Finalize):
            ended = agent.finalize(m.job, eff)
        elif isinstance(eff, lifecycle_effects.Release):
            agent.release(m.job)
        elif isinstance(eff, lifecycle_effects.Requeue):
            agent.requeue(m, eff.reason)
        elif isinstance(eff, lifecycle_effects.RecordRunning):
            who = agent.idents.get(m.job, {})
            started_at = eff.started_at or rfc3339_now()
            agent.db.update(m.job, state="running", pids=list(eff.pids),
                            started_at=started_at, **who)
            agent.idents.pop(m.job, None)  # only once written: a full disk retries it
            agent.scheduler.launched(m.job, started_at)
            log.info("job %d attempt %d running: pids %s", m.job, m.attempt, list(eff.pids))
            if agent.cluster is not None:
                agent.hold(functools.partial(agent.cluster.job_running,
                                             agent.db.get_required(m.job)))
        elif isinstance(eff, lifecycle_effects.RecordPid):
            if eff.pid > 0:
                agent.db.update(m.job, supervisor_pid=eff.pid)
        elif isinstance(eff, lifecycle_effects.Retry):
            agent.timers.at(time.monotonic() + RETRY_UNRESPONSIVE,
                           lambda: agent.feed(m.job, m.attempt, lifecycle_events.Deadline()))
        else:
            agent.hold(agent.outward(m, eff))
    if ended is not None:
        agent.job_ended(ended)
        agent.schedule_due = True


def outward(agent: Agent, m: lifecycle.Machine,
            eff: lifecycle_effects.Effect) -> Callable[[], None]:
    """The effect ``eff`` as an action to be done once the writes before it are durable."""
    def current() -> bool:  # the attempt was not settled and forgotten meanwhile
        now = agent.machines.get(m.job)
        return now is not None and now.attempt == m.attempt

    def act() -> None:
        if isinstance(eff, lifecycle_effects.Spawn):
            if current():
                agent.launch(agent.db.get_required(m.job))
        elif isinstance(eff, lifecycle_effects.Connect):
            if current():
                agent.connect(m, fresh=eff.fresh)
        elif isinstance(eff, lifecycle_effects.Claim):
            link = agent.links.get(m.job)
            if current() and link is not None:
                agent.claim(link)
        elif isinstance(eff, lifecycle_effects.Wait):
            link = agent.links.get(m.job)
            if current() and link is not None:
                agent.wait(link)
        elif isinstance(eff, lifecycle_effects.Terminate):
            link = agent.links.get(m.job)
            if current() and link is not None:
                agent.terminate(link)
        elif isinstance(eff, lifecycle_effects.Ack):
            if current():
                agent.ack(m)
        elif isinstance(eff, lifecycle_effects.Disconnect):
            link = agent.links.get(m.job)
            if link is not None and link.attempt == m.attempt:
                agent.drop_link(link)
        elif isinstance(eff, lifecycle_effects.Kill):
            agent.contain.clean(m.job, m.attempt)
            fallback.kill_leftovers(agent.layout.run_dir(m.job, m.attempt),
                                    agent.db.get(m.job))
        elif isinstance(eff, lifecycle_effects.RemoveRunDir):
            shutil.rmtree(agent.layout.run_dir(m.job, m.attempt).path, ignore_errors=True)
        else:  # pragma: no cover - the effect union is closed
            raise AssertionError(f"unknown effect {eff!r}")
    return act


def finalize(agent: Agent, job_id: int, fin: lifecycle_effects.Finalize) -> Job:
    """Record a final state (durable before anyone is told)."""
    job = agent.db.get_required(job_id)
    fields: dict[str, Any] = {"state": fin.state, "exit_code": fin.exit_code,
                              "signal": fin.signal, "reason": fin.reason,
                              "ended_at": fin.ended_at or rfc3339_now(),
                              "core_dumped": fin.core_dumped, "oom": fin.oom,
                              "pmi_unused": fin.pmi_unused, "suspended_at": None}
    if job.suspended_at is not None:  # a suspended job that ended (cancelled, lost)
        fields["suspended_seconds"] = job.suspended_total(time.time())
    if fin.started_at and not job.started_at:
        fields["started_at"] = fin.started_at
    # the accounting history's row in the same transaction: both, or neither (acct.py)
    own = not agent.db.conn.in_transaction
    if own:
        agent.db.begin()
    try:
        job = agent.db.change(job, **fields)
        acct.record(agent.db, job, fin.usage)
        if own:
            agent.db.commit()
    except BaseException:
        if own:
            agent.db.rollback()
        raise
    log.info("job %d attempt %d %s: exit_code=%s signal=%s%s", job.id, job.attempt,
             fin.state, fin.exit_code, fin.signal, f" ({fin.reason})" if fin.reason else "")
    return job


def cancel(agent: Agent, job: Job) -> None:
    """A cancel was recorded for an active job: tell its machine."""
    agent.feed(job.id, job.attempt, lifecycle_events.CancelRequested())


def cancel_pending(agent: Agent, job: Job) -> Job:
    """A pending job holds nothing and has no machine: cancelled at once."""
    job = agent.finalize(job.id, lifecycle_effects.Finalize(state="cancelled",
                                                   reason="cancelled while pending"))
    agent.job_ended(job)
    return job


def release(agent: Agent, job_id: int) -> None:
    agent.scheduler.released(job_id)
    alloc = agent.allocations.pop(job_id, None)
    if alloc is not None:
        agent.ledger.release(alloc)


def requeue(agent: Agent, m: lifecycle.Machine, why: str) -> None:
    """The attempt never ran: back to the queue (the machine decided it may)."""
    agent.db.update(m.job, state="pending", cpus=[], gpus=[], pids=[],
                   supervisor_pid=None, supervisor_ticks=None, supervisor_boot=None,
                   supervisor_session=None)
    log.warning("job %d attempt %d never ran (%s): back to the queue", m.job, m.attempt,
                why)
    agent.schedule_due = True
