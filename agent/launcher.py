"""Starting a job's attempt: allocate and record it, then spawn its supervisor without waiting.

``start`` is what the scheduler calls for each job its plan starts; the ``Spawn`` effect
(effects.py) calls ``launch``, which builds the supervisor's spec and hands it to the spawner
(spawn.py): the job's user is looked up and its run directory made on the spawner's worker
thread, so the loop waits neither for the user database nor for the file system. What comes of
the spawn is fed back to the job's machine (``Spawned``, ``SpawnFailed``, or the fallback).

The functions take the agent and are bound as its methods (daemon.py ``Agent``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import tether
import tether.shared.records
from tether.agent import batch, fallback, lifecycle, lifecycle_events, users
from tether.agent.group_commit import wait_for_go
from tether.agent.job import Job
from tether.agent.ledger import Request
from tether.agent.spawn_prep import SpawnError
from tether.shared.errors import TetherError
from tether.shared.faults import agent_fault

if TYPE_CHECKING:
    from tether.agent.view import LauncherAgent as Agent

log = logging.getLogger("tether.agent")


def start(agent: Agent, job: Job) -> bool:
    """Allocate, record and spawn one job the plan starts; False if it does not fit."""
    alloc = agent.ledger.allocate(Request(job.cpus_per_task * job.ntasks, job.gpus_req,
                                         job.memory_mb))
    if alloc is None:
        return False
    attempt = job.attempt + 1
    try:
        job = agent.db.change(job, state="starting", attempt=attempt,
                             cpus=list(alloc.cpus), gpus=list(alloc.gpus), pids=[],
                             supervisor_pid=None, supervisor_ticks=None,
                             supervisor_boot=None, supervisor_session=None)
    except BaseException:
        agent.ledger.release(alloc)  # nothing was recorded: nothing is held
        raise
    agent.allocations[job.id] = alloc
    agent.scheduler.started(job)
    machine, effects = lifecycle.start(job.id, attempt, cancel=job.cancel_requested)
    agent.machines[job.id] = machine
    agent.perform(machine, effects)
    return True


def identity(agent: Agent, job: Job, umask: int) -> dict[str, Any]:
    """Who the tasks run as: the job's user, looked up again at launch (groups may change).
    On the spawner's worker thread (``launch``): the user database may be LDAP, and slow."""
    if agent_fault(agent.cfg.faults, "hold-lookup"):
        wait_for_go(agent.layout.state_dir, "lookup")
    user: users.User | None
    try:
        user = users.lookup(job.user) if job.user else users.current()
    except TetherError:
        user = None
    if user is None or (job.uid is not None and user.uid != job.uid):
        raise SpawnError(f"user {job.user!r} (uid {job.uid}) no longer exists as submitted")
    gid = user.gid if job.gid is None else job.gid  # the primary gid it submitted with
    if job.user and gid == user.gid:  # the lookup read the group file for this very gid
        groups = list(user.groups)
    else:
        groups = sorted(set(os.getgrouplist(user.name, gid)))
    return {"uid": user.uid, "gid": gid, "groups": groups, "user": user.name,
            "home": user.home, "umask": umask}


def launch(agent: Agent, job: Job) -> None:
    """Effect ``Spawn`` (L2, L3): feeds ``Spawned`` (once the supervisor is ready) or
    ``SpawnFailed``; nothing here waits, neither for the user database nor for the file
    system (the job's user is looked up, ``identity``, and its run directory made on the
    spawner's worker thread, in one go) nor for the supervisor."""
    rd = agent.layout.run_dir(job.id, job.attempt)
    if agent_fault(agent.cfg.faults, "spawn-fails"):  # test-only: a broken node
        agent.spawn_failed(job.id, job.attempt, SpawnError("no supervisor could be started "
                                                           "(fault spawn-fails)"))
        return
    base = agent.spec_of(job)
    umask = agent.db.umask_of(job.id)

    def spec() -> dict[str, Any]:  # on the spawner's worker thread
        return {**base, **agent.identity(job, umask)}

    def wanted() -> bool:  # on the loop, before the supervisor is started
        m = agent.machines.get(job.id)
        # settled meanwhile (cannot happen before a spawn; never spawn for it)
        return m is not None and m.attempt == job.attempt and \
            m.state is lifecycle.State.STARTING

    def failed(exc: BaseException) -> None:
        if not isinstance(exc, (SpawnError, OSError)):
            exc = SpawnError(f"looking up its user: {exc}")
        agent.spawn_failed(job.id, job.attempt, exc)
    try:
        agent.spawner.spawn(
            rd, spec, wanted=wanted,
            on_pid=lambda pid: log.info("job %d attempt %d: supervisor spawned (pid %d)",
                                        job.id, job.attempt, pid),
            # only once it is bound: hello and claim reach it at once (spawn.py)
            on_ready=lambda: agent.feed(job.id, job.attempt, lifecycle_events.Spawned(pid=0)),
            on_gone=lambda why: agent.spawn_gone(job.id, job.attempt, why),
            on_failed=failed)
    except (SpawnError, OSError) as exc:
        agent.spawn_failed(job.id, job.attempt, exc)


def spec_of(agent: Agent, job: Job) -> dict[str, Any]:
    """The supervisor's spec (spec.json) but for who the tasks run as (``identity``)."""
    per = job.cpus_per_task
    spec = {
        "schema": tether.shared.records.SCHEMA, "job": job.id, "attempt": job.attempt,
        "name": job.name, "command": job.command, "ntasks": job.ntasks,
        "cpus": job.cpus, "gpus": job.gpus, "memory_mb": job.memory_mb,
        "affinity": [sorted({agent.ledger.physical(c) for c in job.cpus[r * per:(r + 1) * per]})
                     for r in range(job.ntasks)],
        "env": job.env, "workdir": job.workdir, "output": job.output, "error": job.error,
        "claim_timeout": agent.cfg.claim_timeout, "linger": agent.cfg.linger,
        "kill_grace": agent.cfg.cancel_grace, "agent_uid": os.getuid(), "pmi": job.pmi,
        # computed, no I/O: safe on the spawner's worker thread
        "cgroup": agent.contain.plan(job.id, job.attempt, job.memory_mb),
    }
    if job.pmi != "none":  # what its PMI key-value store may hold (supervisor/pmi_kvs.py)
        spec["pmi_store_bytes"] = agent.cfg.pmi_store_mb << 20
    xml = agent.topology.for_step(job.pmi)
    if xml is not None:
        spec["hwloc_xml"] = xml  # the tasks load it (topology.py)
    if job.time_limit is not None:
        spec["time_limit"] = job.time_limit  # the supervisor enforces it (survives us)
    if job.array_id is not None:
        spec["array"] = {"id": job.array_id, "index": job.array_index}
    script, slurm_env = batch.of(agent.db, job)
    if script is not None:
        # spawn_prep writes it into the run directory (``script``); the supervisor hands it to
        # the tasks on a file descriptor (shared/batch.py)
        spec["script_data"] = script
    if slurm_env:
        spec["slurm_env"] = True  # Slurm's names of the job variables too (supervisor/launch.py)
        spec["node"] = agent.cfg.node
    if agent.cluster is not None:
        fence = agent.cluster.fence_spec(job.id)
        if fence is not None:
            spec["fence"] = fence  # its tasks end with the node's lease (shared/lease.py)
    return spec


def spawn_failed(agent: Agent, job_id: int, attempt: int, exc: BaseException) -> None:
    """No supervisor could be started for the attempt (unless its lock says otherwise)."""
    log.error("job %d: %s", job_id, exc)
    rd = agent.layout.run_dir(job_id, attempt)
    if os.path.isdir(rd.path) and not fallback.lock_is_free(rd):
        agent.feed(job_id, attempt, lifecycle_events.Spawned(pid=0))  # it did start
    else:
        agent.feed(job_id, attempt, lifecycle_events.SpawnFailed(reason=str(exc)))


def spawn_gone(agent: Agent, job_id: int, attempt: int, why: str) -> None:
    """The new supervisor ended before it was ready (its ready pipe closed unwritten)."""
    log.warning("job %d attempt %d: %s", job_id, attempt, why)
    if fallback.lock_is_free(agent.layout.run_dir(job_id, attempt)):
        agent.gone(job_id, attempt, note=why)
    else:  # someone holds its lock: it lives after all; ask it
        agent.feed(job_id, attempt, lifecycle_events.Spawned(pid=0))
