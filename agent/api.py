"""Requests the agent answers on its door (every local user's CLI): one table of handlers.

Each handler validates its arguments completely before touching anything, so bad input gets a
one-line error and changes nothing (the checks several handlers share, and a submission's, are
in request_args.py).

Who may do what (the caller is the kernel's uid of the connection, never anything it sent):
any user ``hello``, ``status``, ``list``, ``show`` (every job's public fields, as ``squeue``
shows them) and ``submit`` (the job runs as the caller; only root may name another ``user``);
the job's owner, root and the agent's uid ``wait``, ``cancel``, ``hold``, ``release``,
``suspend`` and ``resume``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

import tether
from tether.agent import acct, batch, fallback, retention, users
from tether.agent.job import ACTIVE, FINAL, Job
from tether.agent.ledger import Request as ResourceRequest
from tether.agent.request_args import (
    abs_path_arg,
    array_arg,
    batch_args,
    expand_paths,
    index_arg,
    one_job,
    owner_or_root,
    sched_args,
    submitter,
    targets,
    task_paths,
)
from tether.agent.schema import SCHEMA_VERSION
from tether.shared import jobopts, protocol, records
from tether.shared.door_conn import Conn
from tether.shared.errors import BadRequest, ResourceError, StateError, TetherError, UnknownKind
from tether.shared.protocol import arg_int, arg_number, arg_str, arg_str_list, check_known
from tether.shared.step_cgroup import CgroupError
from tether.shared.timers import rfc3339_now

if TYPE_CHECKING:
    from tether.agent.view import ApiAgent as Agent

log = logging.getLogger("tether.agent")

PENDING = object()
Peer = Conn
Handler = Callable[["Agent", Peer, protocol.Request], Any]
MAX_HOLD = 600.0
#: Tasks per step. Bounds the exit record and the replies that carry it well under MAX_FRAME.
MAX_TASKS = 1024
#: Jobs per ``list`` reply; the CLI pages through the rest.
LIST_PAGE = 500
LIST_PAGE_BYTES = 256 * 1024
#: A job's command line, in bytes: it travels in every reply that shows the job.
MAX_COMMAND_BYTES = 128 * 1024
PMI_KINDS = ("none", "pmi1", "pmi2")
#: The node name keeps two agents' outputs apart in a shared directory (job ids are per agent).
DEFAULT_OUTPUT = "tether-%N-%j.out"
#: An array element's: Slurm's %A_%a
DEFAULT_ARRAY_OUTPUT = "tether-%N-%A_%a.out"


def hello(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("versions",))
    return {"role": "agent", "protocol": protocol.negotiate(req.args.get("versions")),
            "version": tether.__version__, "node": agent.cfg.node, "pid": os.getpid()}


def status(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ())
    out: dict[str, Any] = {"node": agent.cfg.node, "version": tether.__version__,
                           "protocol": protocol.PROTOCOL_VERSION, "schema": SCHEMA_VERSION,
                           "pid": os.getpid(), "state_dir": agent.cfg.state_dir}
    out.update(agent.ledger.usage())
    if agent.ledger.oversubscribed:
        out["oversubscribed"] = {"logical": len(agent.ledger.cpu_ids),
                                 "real": list(agent.ledger.allowed)}
    out["jobs"] = agent.db.counts()
    out["cgroup"] = agent.contain.status()
    out["db_syncs"] = agent.db.syncs  # group commit: fsyncs of the database so far
    out["hwloc_xml"] = agent.topology.ready  # None until gathered, or when off or failed
    out["template"] = agent.spawner.template.status()  # its pid: what an admin looks for
    out["subuid"] = agent.persons.status()  # whose subordinate uids count as whose
    if agent.door is not None:  # connections held, refused, closed to make room
        out["door"] = agent.door.stats()
    if agent.cluster is not None:
        out["cluster"] = {"node": agent.cluster.info.name, "state": agent.cluster.state,
                          "login": agent.cluster.info.login}
    return out


#: the arguments of ``submit``
SUBMIT_ARGS = ("command", "name", "cpus", "gpus", "memory_mb", "ntasks", "output", "error",
               "workdir", "env", "pmi", "user", "umask", "time_limit", "hold", "dependency",
               "array", "begin")


def submission_args(args: Any, kind: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """A submission's own arguments, checked (on one node and for a cluster alike): the
    command, counts, paths (absolute, relative ones under ``workdir``), env, PMI, user."""
    check_known(args, kind, SUBMIT_ARGS + extra)
    command = arg_str_list(args, "command")
    if not command or not command[0]:
        raise BadRequest("a job needs a command")
    if sum(len(a.encode()) + 1 for a in command) > MAX_COMMAND_BYTES:
        raise BadRequest(f"the command line is longer than {MAX_COMMAND_BYTES} bytes")
    out: dict[str, Any] = {"command": command}
    out["cpus"] = arg_int(args, "cpus", default=1, minimum=1, maximum=1 << 20)
    out["gpus"] = arg_int(args, "gpus", default=0, minimum=0, maximum=1 << 16)
    out["memory_mb"] = arg_int(args, "memory_mb", default=0, minimum=0, maximum=1 << 40)
    out["ntasks"] = arg_int(args, "ntasks", default=1, minimum=1, maximum=MAX_TASKS)
    out["umask"] = arg_int(args, "umask", default=0o022, minimum=0, maximum=0o777)
    workdir = arg_str(args, "workdir")
    assert workdir is not None
    if not os.path.isabs(workdir):
        raise BadRequest(f"working directory {workdir!r} must be an absolute path")
    out["workdir"] = workdir = os.path.normpath(workdir)
    env = args.get("env", {})
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
        for k, v in env.items()
    ):
        raise BadRequest("'env' must map variable names to string values")
    out["env"] = env
    out["name"] = (arg_str(args, "name", optional=True, max_len=256)
                   or os.path.basename(command[0])[:256])
    pmi = arg_str(args, "pmi", default="none")
    if pmi not in PMI_KINDS:
        raise BadRequest(f"unknown PMI {pmi!r}: use one of {', '.join(PMI_KINDS)}")
    out["pmi"] = pmi
    out["output"] = abs_path_arg(args, "output", workdir)
    out["error"] = abs_path_arg(args, "error", workdir)
    out["user"] = arg_str(args, "user", optional=True, max_len=64)
    hold = args.get("hold", False)
    if not isinstance(hold, bool):
        raise BadRequest("argument 'hold' must be true or false")
    out["hold"] = hold
    return out


def submit(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    args = req.args
    if args.get("requeue") is not None:
        raise BadRequest("--no-requeue applies to cluster jobs: this agent is no cluster's "
                         "member")
    sub = submission_args(args, req.kind, extra=("requeue", "script", "slurm_env"))
    script, slurm_env = batch_args(args)  # a batch script's copy; Slurm's variable names
    command, cpus, gpus, memory, ntasks, umask, workdir, env, name, pmi, output, error, \
        user_name = (sub[k] for k in ("command", "cpus", "gpus", "memory_mb", "ntasks", "umask",
                                      "workdir", "env", "name", "pmi", "output", "error",
                                      "user"))
    sched = sched_args(agent, args)
    indices, array_max = array_arg(args)
    why = agent.ledger.never_fits(ResourceRequest(cpus * ntasks, gpus, memory))
    if why:
        per = f" ({ntasks} tasks x {cpus} CPUs)" if ntasks > 1 else ""
        raise ResourceError(f"job can never run on node {agent.cfg.node}: it {why}{per}")
    # The output paths name the job id, so the id is reserved now and the job recorded only
    # once the user's side checked out: a refused job, or one whose submitter went away
    # meanwhile, leaves no trace. An array reserves one id per element, consecutive.
    count = len(indices) if indices else 1
    # her pending jobs' limit, refused at once where she is the caller (retention.py)
    retention.check_queued(agent, peer.uid if user_name is None else None, count)
    job_id = agent.reserve_id(count)
    ids = range(job_id, job_id + count)
    node = agent.cfg.node
    array_id = job_id if indices else None

    def check(deadline: float, timeout: float) -> tuple[users.User, list[tuple[str, str]]]:
        """On a thread (checks.py): who the user is (NSS may be slow), her file names (``%u``),
        and, as that user, whether the workdir can be entered and the outputs written (root
        would see what she cannot), by ``deadline`` (``timeout`` seconds from its start)."""
        user = submitter(peer, user_name)
        default = os.path.join(workdir, DEFAULT_ARRAY_OUTPUT if indices else DEFAULT_OUTPUT)
        names = [expand_paths(i, name, output or default, error or output or default,
                              user.name, node, array_id, indices[k] if indices else None)
                 for k, i in enumerate(ids)]
        paths = sorted(set().union(*(task_paths(out, err, ntasks) for out, err in names)))
        if user.uid == os.geteuid():
            users.check_own_access(workdir, paths)
        else:
            users.check_access(user, workdir, paths, timeout=timeout, deadline=deadline)
        return user, names

    def checked(got: tuple[users.User, list[tuple[str, str]]] | None,
                exc: BaseException | None) -> None:
        agent.release_id(job_id, count)
        if peer.closed:
            return  # nobody to tell the id to: nothing is recorded
        if exc is not None:
            if not isinstance(exc, TetherError):
                log.error("submit check failed: %s", exc, exc_info=exc)
                exc = TetherError("internal error")
            agent.reply(peer, protocol.error(req.id, exc))
            return
        assert got is not None
        user, names = got
        now = rfc3339_now()
        try:
            agent.db.begin()
            try:
                # the array's variables are the job's own: none inherited from the submitter
                # (a job submitted from inside an array element is no element itself)
                facts = jobopts.array_facts(indices) if indices else {}
                own = {k: v for k, v in env.items() if not k.startswith("TETHER_ARRAY_")}
                # her limits (pending jobs, her share of the state directory): retention.py
                retention.admit(agent, user.uid, user.name, count, retention.record_size(
                    command, {**own, **facts}, name, workdir, names))
                for k, i in enumerate(ids):
                    out, err = names[k]
                    agent.db.insert(
                        id=i, name=name, command=command, state="pending", cpus_per_task=cpus,
                        ntasks=ntasks, gpus_req=gpus, memory_mb=memory, output=out, error=err,
                        workdir=workdir, env={**own, **facts}, submitted_at=now, pmi=pmi,
                        user=user.name, uid=user.uid, gid=user.gid)
                    agent.db.set_umask(i, umask)
                    element = ({"array_id": array_id, "array_index": indices[k],
                                "array_max": array_max} if indices else {})
                    if sched or element:
                        agent.db.set_sched(i, **sched, **element)
                if script is not None or slurm_env:  # one row for all the elements
                    batch.record(agent.db, job_id, count, script, slurm_env)
                agent.db.commit()
            except BaseException:
                agent.db.rollback()
                raise
        except TetherError as full:  # a full state directory: nothing recorded, say so
            agent.reply(peer, protocol.error(req.id, full))
            return
        agent.schedule_due = True
        agent.reply(peer, protocol.ok(req.id, agent.public(agent.db.get_required(job_id))))
    try:
        agent.checks.start(peer, user_name, check, checked)
    except BaseException:
        agent.release_id(job_id, count)
        raise
    return PENDING


def list_jobs(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    """A page of the node's own jobs (on a cluster's member too with ``local``, for ``top``)."""
    check_known(req.args, req.kind, ("after", "limit", "local"))
    after = arg_int(req.args, "after", default=0, minimum=0)
    limit = arg_int(req.args, "limit", default=LIST_PAGE, minimum=1, maximum=LIST_PAGE)
    jobs = agent.db.page(after, limit + 1)
    return paged([agent.public(job) for job in jobs[:limit]], limit, len(jobs) > limit)


def paged(rows: list[dict[str, Any]], limit: int, more: bool) -> dict[str, Any]:
    """A page of ``rows`` (at most ``limit``; ``more``: further rows follow) that fits in one
    frame: it ends early once the encoded rows pass LIST_PAGE_BYTES (one row at least)."""
    out: list[dict[str, Any]] = []
    size = 0
    for row in rows[:limit]:
        size += len(msgpack.packb(row))
        if out and size > LIST_PAGE_BYTES:
            return {"jobs": out, "more": True}
        out.append(row)
    return {"jobs": out, "more": more or len(rows) > limit}


def acct_args(args: Any, kind: str) -> dict[str, Any]:
    """``acct``'s arguments, checked (on one node and for a cluster alike)."""
    check_known(args, kind, ("after", "limit", "jobs", "users", "states", "names", "since",
                             "until", "mine"))
    after = arg_int(args, "after", default=0, minimum=0)
    limit = arg_int(args, "limit", default=LIST_PAGE, minimum=1, maximum=LIST_PAGE)
    refs = None
    if args.get("jobs") is not None:
        jobs = args["jobs"]
        if not isinstance(jobs, list) or len(jobs) > 1000 or not all(
                isinstance(r, list) and len(r) == 2 and isinstance(r[0], int)
                and not isinstance(r[0], bool) and (r[1] is None or isinstance(r[1], int)
                                                    and not isinstance(r[1], bool))
                for r in jobs):
            raise BadRequest("argument 'jobs' must be a list of [ID, INDEX or null]")
        refs = [(int(r[0]), None if r[1] is None else int(r[1])) for r in jobs]
    lists = {key: None if args.get(key) is None else arg_str_list(args, key, max_items=1000)
             for key in ("users", "states", "names")}
    since = None if args.get("since") is None else arg_number(args, "since", default=0.0,
                                                              maximum=1e11)
    until = None if args.get("until") is None else arg_number(args, "until", default=0.0,
                                                              maximum=1e11)
    mine = args.get("mine", False)
    if not isinstance(mine, bool):
        raise BadRequest("argument 'mine' must be true or false")
    return {"after": after, "limit": limit, "refs": refs, "lists": lists, "since": since,
            "until": until, "mine": mine}


def acct_jobs(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    """A page of the accounting history (agent/acct.py), filtered here: ``jobs`` ([ID, INDEX
    or None], ...), ``users``, ``states``, ``names`` (lists), ``since``/``until`` (epoch
    seconds), ``mine`` (the caller's own jobs, by the kernel's uid of the connection)."""
    a = acct_args(req.args, req.kind)
    after, limit, refs, lists, since, until, mine = (
        a[k] for k in ("after", "limit", "refs", "lists", "since", "until", "mine"))
    rows = acct.query(agent.db, after=after, limit=limit + 1, refs=refs, users=lists["users"],
                      states=lists["states"], names=lists["names"], since=since, until=until,
                      uid=peer.uid if mine else None)
    return paged([acct.public(row, agent.cfg.node) for row in rows[:limit]], limit,
                 len(rows) > limit)


def show(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job", "index"))
    return agent.public(one_job(agent, req.args))


def wait(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    """Park until the job ends; for an array's id (without ``index``) until every element
    has, answered with the first element that did not complete (else the last)."""
    check_known(req.args, req.kind, ("job", "hold", "index"))
    index = index_arg(req.args)
    jobs = targets(agent, arg_int(req.args, "job", minimum=1), index)
    for job in jobs:
        owner_or_root(agent, peer, job, "wait")
    hold = arg_number(req.args, "hold", default=30.0, maximum=MAX_HOLD)
    whole = len(jobs) > 1 or (jobs[0].array_id == jobs[0].id and index is None)
    if all(job.final for job in jobs):
        return {"done": True, "job": agent.public(array_outcome(jobs) if whole else jobs[0])}
    agent.add_waiter(-jobs[0].id if whole else jobs[0].id, peer, req.id, hold)
    return PENDING


def array_outcome(jobs: list[Job]) -> Job:
    """An array's result, as ``wait`` gives it: its first element that did not complete, else
    its last."""
    return next((j for j in jobs if j.state != "completed"), jobs[-1])


def cancel(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    """Cancel a job, an array element, or every element of an array not ended yet."""
    check_known(req.args, req.kind, ("job", "index"))
    index = index_arg(req.args)
    jobs = targets(agent, arg_int(req.args, "job", minimum=1), index)
    for job in jobs:
        owner_or_root(agent, peer, job, "cancel")
    live = [job for job in jobs if job.state not in FINAL]
    if not live:
        what = "every element of array" if len(jobs) > 1 else "job"
        raise StateError(f"{what} {jobs[0].id if index is None else f'{jobs[0].array_id}_{index}'}"
                         f" has already ended ({jobs[-1].state})")
    for job in live:
        if job.state == "pending":
            agent.cancel_pending(job)
            continue
        assert job.state in ACTIVE
        job = agent.db.change(job, cancel_requested=True)  # durable before anything is sent
        agent.cancel(job)
    return agent.public(agent.db.get_required(live[0].id))


def _hold_or_release(agent: Agent, peer: Peer, req: protocol.Request, held: bool) -> Any:
    check_known(req.args, req.kind, ("job", "index"))
    index = index_arg(req.args)
    jobs = targets(agent, arg_int(req.args, "job", minimum=1), index)
    verb = "hold" if held else "release"
    for job in jobs:
        owner_or_root(agent, peer, job, verb)
    pending = [job for job in jobs if job.state == "pending"]
    if not pending:
        raise StateError(f"job {jobs[0].id if index is None else f'{jobs[0].array_id}_{index}'}"
                         f" is {jobs[0].state}: only a pending job can be "
                         f"{'held' if held else 'released'}")
    agent.db.begin()
    try:
        for job in pending:
            agent.db.set_sched(job.id, held=held)
        agent.db.commit()
    except BaseException:
        agent.db.rollback()
        raise
    agent.schedule_due = True
    return {"jobs": [job.id for job in pending]}


def hold(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    return _hold_or_release(agent, peer, req, True)


def release(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    return _hold_or_release(agent, peer, req, False)


def suspend(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    """Freeze the job's cgroup; its row stays ``running`` and ``suspended_at`` says since when
    (written after the freeze: a failed freeze records nothing)."""
    check_known(req.args, req.kind, ("job", "index"))
    job = one_job(agent, req.args)
    owner_or_root(agent, peer, job, "suspend")
    if job.suspended:
        raise StateError(f"job {job.id} is already suspended")
    if job.state != "running" or job.cancel_requested:
        why = "being cancelled" if job.cancel_requested else job.state
        raise StateError(f"job {job.id} is {why}: only a running job can be suspended")
    try:
        agent.contain.freeze(job.id, job.attempt)
    except CgroupError as exc:
        # it ended as we asked (the agent has not heard yet): say so, not why a freeze failed
        if fallback.step_over(agent.layout.run_dir(job.id, job.attempt), job):
            raise StateError(f"job {job.id} has ended: there is nothing to suspend") from None
        raise StateError(f"cannot suspend job {job.id}: {exc}") from None
    try:
        job = agent.db.change(job, suspended_at=time.time())
    except Exception:
        agent.contain.thaw(job.id, job.attempt)  # not recorded: not suspended either
        raise
    _note_suspension(agent, job)
    log.info("job %d suspended (uid %d)", job.id, peer.uid)
    return agent.public(job)


def resume(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job", "index"))
    job = one_job(agent, req.args)
    owner_or_root(agent, peer, job, "resume")
    if not job.suspended:
        raise StateError(f"job {job.id} is {agent.public(job)['state']}, not suspended")
    # Recorded first: a crash after it leaves the job running in the record and frozen in the
    # kernel at worst, which cancel settles (it thaws); the reverse would count a running
    # job's time as suspended. (The reply waits for the write to be durable: group commit.)
    job = agent.db.change(job, suspended_at=None,
                          suspended_seconds=job.suspended_total(time.time()))
    try:
        agent.contain.thaw(job.id, job.attempt)
    except CgroupError as exc:
        raise StateError(f"cannot resume job {job.id}: {exc}") from None
    _note_suspension(agent, job)
    log.info("job %d resumed (uid %d)", job.id, peer.uid)
    return agent.public(job)


def _note_suspension(agent: Agent, job: Job) -> None:
    """Tell the step's supervisor, through its run directory, how long the job has been
    suspended: its time limit counts run time only. Best effort (not durable: a power cut
    ends the step too); a failure is logged, the suspension stands."""
    agent.schedule_due = True  # its expected end changed: backfill plans by it (scheduler.py)
    rd = agent.layout.run_dir(job.id, job.attempt)
    try:
        records.atomic_write_json(rd.suspension, {
            "schema": records.SCHEMA, "job": job.id, "attempt": job.attempt,
            "seconds": job.suspended_seconds, "since": job.suspended_at}, durable=False)
    except OSError as exc:
        log.error("job %d: cannot write %s: %s (its time limit counts the suspension)",
                  job.id, rd.suspension, exc)


HANDLERS: dict[str, Handler] = {
    "hello": hello,
    "status": status,
    "submit": submit,
    "list": list_jobs,
    "show": show,
    "wait": wait,
    "cancel": cancel,
    "hold": hold,
    "release": release,
    "suspend": suspend,
    "resume": resume,
    "acct": acct_jobs,
}


#: requests only a cluster's member answers
CLUSTER_KINDS = ("nodes", "drain", "locate")


def dispatch(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    if agent.cluster_requests is not None and req.kind in agent.cluster_requests.kinds:
        # a cluster's member: jobs are the cluster's (cluster_api.py)
        protocol.check_kind_version(req)
        return agent.cluster_requests.dispatch(peer, req)
    handler = HANDLERS.get(req.kind)
    if handler is None:
        if req.kind in CLUSTER_KINDS:
            raise StateError(f"{req.kind!r} needs a cluster: the agent of node {agent.cfg.node} "
                             "is no cluster's member")
        raise UnknownKind(f"unknown request kind {req.kind!r}")
    protocol.check_kind_version(req)
    return handler(agent, peer, req)
