"""The reattach pass at the agent's start: find every supervisor again, or what became of it.

Before the agent serves, every active job in the database gets its machine back
(``lifecycle.adopt``) and its allocation back in the ledger; a supervisor whose run directory's
lock is free is resolved from disk at once (follow.py ``gone``); a live one is probed (hello,
then claim) once the loop serves, concurrently with requests (daemon.py ``step``). Run
directories of no active attempt are orphans: an unacknowledged result is acknowledged, a
leftover removed; step cgroups whose supervisor is gone are cleaned.

The functions take the agent and are bound as its methods (daemon.py ``Agent``).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import TYPE_CHECKING

from tether.agent import fallback, lifecycle, lifecycle_events
from tether.agent.job import ACTIVE, Job
from tether.agent.ledger import Conflict
from tether.shared.paths import RunDir

if TYPE_CHECKING:
    from tether.agent.view import RecoveryAgent as Agent

log = logging.getLogger("tether.agent")


def reattach_done(agent: Agent) -> None:
    if agent.reattach_t0 is not None and not agent.reattaching:
        agent.reattach_seconds = time.monotonic() - agent.reattach_t0
        log.info("reattach: every live supervisor answered %.0f ms after the start",
                 agent.reattach_seconds * 1000)
        agent.reattach_t0 = None


def reattach(agent: Agent) -> None:
    """Before serving: find every supervisor again, or find out what became of it."""
    active = agent.db.in_states(*ACTIVE)
    for job in active:
        try:
            agent.reattach_one(job)
        except Exception:  # one bad job must not keep the node from starting
            log.exception("job %d: reattach failed", job.id)
    wanted = {(j.id, j.attempt) for j in active}
    for rd in agent.layout.run_dirs():
        if (rd.job, rd.attempt) in wanted:
            continue
        try:
            agent.orphan(rd)
        except Exception:  # one odd directory must not keep the node from starting
            log.exception("%s: could not be examined", rd.path)
    for job_id, attempt in agent.contain.steps_present():
        if fallback.lock_is_free(agent.layout.run_dir(job_id, attempt)):
            agent.contain.clean(job_id, attempt)  # its supervisor is gone: a leftover
    log.info("reattach: %d active job(s), %d to probe", len(active), len(agent.reattaching))


def reattach_one(agent: Agent, job: Job) -> None:
    agent.machines[job.id] = lifecycle.adopt(job.id, job.attempt,
                                            running=job.state == "running",
                                            cancel=job.cancel_requested)
    agent.reattaching.add(job.id)
    try:
        agent.ledger.adopt(job.allocation)
    except Conflict as exc:
        log.error("job %d: its allocation conflicts with this node's (%s); NOT adopting "
                  "it: marked lost, its supervisor (pid %s) is left alone", job.id, exc,
                  job.supervisor_pid)
        agent.feed(job.id, job.attempt, lifecycle_events.Conflict(reason=str(exc)))
        return
    agent.allocations[job.id] = job.allocation
    agent.scheduler.running(job)
    agent.feed(job.id, job.attempt, lifecycle_events.Restored())
    rd = agent.layout.run_dir(job.id, job.attempt)
    if not os.path.isdir(rd.path):
        agent.feed(job.id, job.attempt, lifecycle_events.NoRunDir(path=rd.path))
    elif fallback.lock_is_free(rd):
        agent.gone(job.id, job.attempt)
    else:
        # Probed once the agent serves (``step``): the hellos wake every live supervisor
        # at once, and on a small node their answers would hold up the first request.
        agent.probes.append((job.id, job.attempt))


def orphan(agent: Agent, rd: RunDir) -> None:
    """A run directory of no active attempt: an unacknowledged result, or a leftover."""
    job = agent.db.get(rd.job)
    if fallback.lock_is_free(rd):
        if job is None:
            log.error("run directory %s belongs to no known job; removing it", rd.path)
        shutil.rmtree(rd.path, ignore_errors=True)
        return
    if job is not None and job.final and job.attempt == rd.attempt:
        # C2 happened, C3 (ack) did not: acknowledge now.
        machine, effects = lifecycle.orphan(rd.job, rd.attempt)
        agent.machines[rd.job] = machine
        agent.perform(machine, effects)
        return
    log.error("a live supervisor in %s serves no attempt this agent knows about; leaving "
              "it alone", rd.path)
