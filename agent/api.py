"""Requests the agent answers on its door (every local user's CLI): one table of handlers.

Each handler validates its arguments completely before touching anything, so bad input gets a
one-line error and changes nothing.

Who may do what (the caller is the kernel's uid of the connection, never anything it sent):
any user ``hello``, ``status``, ``list``, ``show`` (every job's public fields, as ``squeue``
shows them) and ``submit`` (the job runs as the caller; only root may name another ``user``);
the job's owner, root and the agent's uid ``wait`` and ``cancel``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

import tether
from tether.agent import users
from tether.agent.db import ACTIVE, FINAL, SCHEMA_VERSION, Job
from tether.agent.ledger import Request as ResourceRequest
from tether.shared import outpattern, protocol
from tether.shared.cgroup import CgroupError
from tether.shared.door import Conn
from tether.shared.errors import (
    BadRequest,
    NotFound,
    PermissionDenied,
    ResourceError,
    StateError,
    TetherError,
    UnknownKind,
)
from tether.shared.protocol import arg_int, arg_number, arg_str, arg_str_list, check_known
from tether.shared.timers import rfc3339_now

if TYPE_CHECKING:
    from tether.agent.daemon import Agent

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
    out["jobs"] = agent.db.counts()
    out["cgroup"] = agent.contain.status()
    out["db_syncs"] = agent.db.syncs  # group commit: fsyncs of the database so far
    return out


def _job(agent: Agent, args: Any) -> Any:
    job_id = arg_int(args, "job", minimum=1)
    job = agent.db.get(job_id)
    if job is None:
        raise NotFound(f"no job {job_id}")
    return job


def _abs_path(args: Any, name: str, workdir: str) -> str | None:
    value = arg_str(args, name, optional=True)
    if value is None or value == "":
        return None
    return os.path.normpath(os.path.join(workdir, value))


def _owner_or_root(agent: Agent, peer: Peer, job: Any, verb: str) -> None:
    owner = job.uid if job.uid is not None else os.getuid()
    if peer.uid in (0, os.getuid(), owner):
        return
    raise PermissionDenied(f"permission denied: {verb!r} of job {job.id} is for its owner "
                           f"({job.user or f'uid {owner}'}) and root only (you are uid "
                           f"{peer.uid})")


def _submitter(peer: Peer, user_name: str | None) -> users.User:
    """Who the job runs as: the caller, as the kernel names it; root may name anyone."""
    if user_name is not None:
        if os.geteuid() != 0:
            raise BadRequest("--user needs an agent running as root")
        if peer.uid != 0:
            me = users.by_uid(peer.uid, peer.gid)
            if me.name != user_name:
                raise PermissionDenied(f"permission denied: only root may submit as another "
                                       f"user (you are {me.name}, uid {peer.uid})")
            return me
        return users.lookup(user_name)
    if peer.uid != os.geteuid() and os.geteuid() != 0:
        raise PermissionDenied(f"permission denied: this agent runs as uid {os.geteuid()} and "
                               f"can only run that user's jobs (you are uid {peer.uid})")
    if peer.uid == os.geteuid():
        return users.current()
    return users.by_uid(peer.uid, peer.gid)


def expand_paths(job_id: int, name: str, output: str, error: str, user: str, node: str,
                 array_id: int | None = None, array_index: int | None = None,
                 ) -> tuple[str, str]:
    """The output and error names with the job's tokens expanded (``%t`` is left to the
    supervisor, which gives each task its files). Nothing is looked at on disk."""
    values = {"j": str(job_id), "x": name, "u": user, "N": node,
              "A": str(job_id if array_id is None else array_id),
              "a": str(array_index or 0)}
    return outpattern.for_job(output, values), outpattern.for_job(error, values)


def output_paths(job: Job, output: str, error: str, user: str, node: str) -> tuple[str, str]:
    """``expand_paths`` for a recorded job; each name's directory must exist (checked by this
    process: a submission checks them as its user instead, ``users.check_access``)."""
    out, err = expand_paths(job.id, job.name, output, error, user, node,
                            getattr(job, "array_id", None),  # arrays: the scheduler's columns
                            getattr(job, "array_index", None))
    for label, path in (("output", out), ("error", err)):
        if not os.path.isdir(os.path.dirname(outpattern.for_task(path, 0))):
            raise BadRequest(f"{label} file {path}: its directory does not exist")
    return out, err


def task_paths(out: str, err: str, ntasks: int) -> set[str]:
    """Every file the tasks will write: one pair, or one per task with ``%t``."""
    ranks = range(ntasks) if outpattern.per_task(out) or outpattern.per_task(err) else [0]
    return {outpattern.for_task(p, r) for r in ranks for p in (out, err)}


def submit(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    args = req.args
    check_known(args, req.kind, ("command", "name", "cpus", "gpus", "memory_mb", "ntasks",
                                 "output", "error", "workdir", "env", "pmi", "user", "umask"))
    command = arg_str_list(args, "command")
    if not command or not command[0]:
        raise BadRequest("a job needs a command")
    if sum(len(a.encode()) + 1 for a in command) > MAX_COMMAND_BYTES:
        raise BadRequest(f"the command line is longer than {MAX_COMMAND_BYTES} bytes")
    cpus = arg_int(args, "cpus", default=1, minimum=1, maximum=1 << 20)
    gpus = arg_int(args, "gpus", default=0, minimum=0, maximum=1 << 16)
    memory = arg_int(args, "memory_mb", default=0, minimum=0, maximum=1 << 40)
    ntasks = arg_int(args, "ntasks", default=1, minimum=1, maximum=MAX_TASKS)
    umask = arg_int(args, "umask", default=0o022, minimum=0, maximum=0o777)
    workdir = arg_str(args, "workdir")
    assert workdir is not None
    if not os.path.isabs(workdir):
        raise BadRequest(f"working directory {workdir!r} must be an absolute path")
    workdir = os.path.normpath(workdir)
    env = args.get("env", {})
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
        for k, v in env.items()
    ):
        raise BadRequest("'env' must map variable names to string values")
    name = arg_str(args, "name", optional=True, max_len=256) or os.path.basename(command[0])[:256]
    pmi = arg_str(args, "pmi", default="none")
    if pmi not in PMI_KINDS:
        raise BadRequest(f"unknown PMI {pmi!r}: use one of {', '.join(PMI_KINDS)}")
    output = _abs_path(args, "output", workdir)
    error = _abs_path(args, "error", workdir)
    user_name = arg_str(args, "user", optional=True, max_len=64)
    why = agent.ledger.never_fits(ResourceRequest(cpus * ntasks, gpus, memory))
    if why:
        per = f" ({ntasks} tasks x {cpus} CPUs)" if ntasks > 1 else ""
        raise ResourceError(f"job can never run on node {agent.cfg.node}: it {why}{per}")
    # The output paths name the job id, so the id is reserved now and the job recorded only
    # once the user's side checked out: a refused job, or one whose submitter went away
    # meanwhile, leaves no trace.
    job_id = agent.reserve_id()
    node = agent.cfg.node

    def check() -> tuple[users.User, str, str]:
        """On the worker thread: who the user is (NSS may be slow), her file names (``%u``),
        and, as that user, whether the workdir can be entered and the outputs written (root
        would see what she cannot)."""
        user = _submitter(peer, user_name)
        default = os.path.join(workdir, DEFAULT_OUTPUT)
        out, err = expand_paths(job_id, name, output or default, error or output or default,
                                user.name, node)
        paths = sorted(task_paths(out, err, ntasks))
        if user.uid == os.geteuid():
            users.check_own_access(workdir, paths)
        else:
            users.check_access(user, workdir, paths)
        return user, out, err

    def checked(got: tuple[users.User, str, str] | None, exc: BaseException | None) -> None:
        agent.release_id(job_id)
        if peer.closed:
            return  # nobody to tell the id to: nothing is recorded
        if exc is not None:
            if not isinstance(exc, TetherError):
                log.error("submit check failed: %s", exc, exc_info=exc)
                exc = TetherError("internal error")
            agent.reply(peer, protocol.error(req.id, exc))
            return
        assert got is not None
        user, out, err = got
        try:
            agent.db.begin()
            try:
                job = agent.db.insert(
                    id=job_id, name=name, command=command, state="pending", cpus_per_task=cpus,
                    ntasks=ntasks, gpus_req=gpus, memory_mb=memory, output=out, error=err,
                    workdir=workdir, env=env, submitted_at=rfc3339_now(), pmi=pmi,
                    user=user.name, uid=user.uid, gid=user.gid)
                agent.db.set_umask(job_id, umask)
                agent.db.commit()
            except BaseException:
                agent.db.rollback()
                raise
        except TetherError as full:  # a full state directory: nothing recorded, say so
            agent.reply(peer, protocol.error(req.id, full))
            return
        agent.schedule_due = True
        agent.reply(peer, protocol.ok(req.id, job.public()))
    try:
        agent.offload.submit(check, checked, "submissions")
    except BaseException:
        agent.release_id(job_id)
        raise
    return PENDING


def list_jobs(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("after", "limit"))
    after = arg_int(req.args, "after", default=0, minimum=0)
    limit = arg_int(req.args, "limit", default=LIST_PAGE, minimum=1, maximum=LIST_PAGE)
    jobs = agent.db.page(after, limit + 1)
    out: list[dict[str, Any]] = []
    size = 0
    for job in jobs[:limit]:
        pub = job.public()
        size += len(msgpack.packb(pub))
        if out and size > LIST_PAGE_BYTES:  # by size too: a page must fit in one frame
            return {"jobs": out, "more": True}
        out.append(pub)
    return {"jobs": out, "more": len(jobs) > limit}


def show(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job",))
    return _job(agent, req.args).public()


def wait(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job", "hold"))
    job = _job(agent, req.args)
    _owner_or_root(agent, peer, job, "wait")
    hold = arg_number(req.args, "hold", default=30.0, maximum=MAX_HOLD)
    if job.final:
        return {"done": True, "job": job.public()}
    agent.add_waiter(job.id, peer, req.id, hold)
    return PENDING


def cancel(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job",))
    job = _job(agent, req.args)
    _owner_or_root(agent, peer, job, "cancel")
    if job.state in FINAL:
        raise StateError(f"job {job.id} has already ended ({job.state})")
    if job.state == "pending":
        return agent.cancel_pending(job).public()
    assert job.state in ACTIVE
    job = agent.db.update(job.id, cancel_requested=1)  # durable before anything is sent
    agent.cancel(job)
    return job.public()


def suspend(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    """Freeze the job's cgroup; its row stays ``running`` and ``suspended_at`` says since when
    (written after the freeze: a failed freeze records nothing)."""
    check_known(req.args, req.kind, ("job",))
    job = _job(agent, req.args)
    _owner_or_root(agent, peer, job, "suspend")
    if job.suspended:
        raise StateError(f"job {job.id} is already suspended")
    if job.state != "running" or job.cancel_requested:
        why = "being cancelled" if job.cancel_requested else job.state
        raise StateError(f"job {job.id} is {why}: only a running job can be suspended")
    try:
        agent.contain.freeze(job.id, job.attempt)
    except CgroupError as exc:
        raise StateError(f"cannot suspend job {job.id}: {exc}") from None
    try:
        job = agent.db.update(job.id, suspended_at=time.time())
    except Exception:
        agent.contain.thaw(job.id, job.attempt)  # not recorded: not suspended either
        raise
    log.info("job %d suspended (uid %d)", job.id, peer.uid)
    return job.public()


def resume(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("job",))
    job = _job(agent, req.args)
    _owner_or_root(agent, peer, job, "resume")
    if not job.suspended:
        raise StateError(f"job {job.id} is {job.public()['state']}, not suspended")
    # Recorded first: a crash after it leaves the job running in the record and frozen in the
    # kernel at worst, which cancel settles (it thaws); the reverse would count a running
    # job's time as suspended. (The reply waits for the write to be durable: group commit.)
    job = agent.db.update(job.id, suspended_at=None,
                          suspended_seconds=job.suspended_total(time.time()))
    try:
        agent.contain.thaw(job.id, job.attempt)
    except CgroupError as exc:
        raise StateError(f"cannot resume job {job.id}: {exc}") from None
    log.info("job %d resumed (uid %d)", job.id, peer.uid)
    return job.public()


HANDLERS: dict[str, Handler] = {
    "hello": hello,
    "status": status,
    "submit": submit,
    "list": list_jobs,
    "show": show,
    "wait": wait,
    "cancel": cancel,
    "suspend": suspend,
    "resume": resume,
}


def dispatch(agent: Agent, peer: Peer, req: protocol.Request) -> Any:
    handler = HANDLERS.get(req.kind)
    if handler is None:
        raise UnknownKind(f"unknown request kind {req.kind!r}")
    protocol.check_kind_version(req)
    return handler(agent, peer, req)
