"""The arguments of the agent's requests, read and checked before a handler (api.py) touches
anything: which jobs a request names and whether the caller may act on them, and for a
submission who it runs as, its file names, its scheduling facts and its array.

Apart from the handlers so that api.py reads as what each request does; nothing here changes
any state (it reads the database and the user database).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from tether.agent import users
from tether.agent.job import Job
from tether.shared import batch, jobopts, outpattern
from tether.shared.door_conn import Conn
from tether.shared.errors import BadRequest, NotFound, PermissionDenied
from tether.shared.protocol import arg_int, arg_number, arg_str

if TYPE_CHECKING:
    from tether.agent.view import RequestArgsAgent as Agent

#: Jobs one submission may depend on, arrays counted element by element.
MAX_DEPENDENCIES = 1000


def job_arg(agent: Agent, args: Any) -> Any:
    job_id = arg_int(args, "job", minimum=1)
    job = agent.db.get(job_id)
    if job is None:
        raise missing(agent, job_id)
    return job


def missing(agent: Agent, job_id: int, index: int | None = None) -> NotFound:
    """No job by that id in the jobs table: a job that ended and was purged (retention.py)
    says so, and where it is still found."""
    what = f"{job_id}" if index is None else f"{job_id}_{index}"
    if job_id > agent.db.last_id():
        return NotFound(f"no job {what}")
    row = agent.db.conn.execute(
        "SELECT state FROM job_acct WHERE job = ?" if index is None else
        "SELECT state FROM job_acct WHERE array_id = ? AND array_index = ?",
        (job_id,) if index is None else (job_id, index)).fetchone()
    if row is None:
        return NotFound(f"no job {what}")
    return NotFound(f"job {what} ended ({row[0]}) and has been purged from the jobs table "
                    "(agent --keep-ended, --keep-ended-count): tether acct shows it")


def index_arg(args: Any) -> int | None:
    if args.get("index") is None:
        return None
    return arg_int(args, "index", minimum=0, maximum=jobopts.MAX_INDEX)


def one_job(agent: Agent, args: Any) -> Job:
    """The job ``job`` (and ``index``, an array element) names, itself."""
    index = index_arg(args)
    if index is None:
        job: Job = job_arg(agent, args)
        return job
    return targets(agent, arg_int(args, "job", minimum=1), index)[0]


def targets(agent: Agent, job_id: int, index: int | None) -> list[Job]:
    """The jobs a reference names: ``ID_INDEX`` one element; ``ID`` the job, or every element
    when ID is an array's (Slurm: ``scancel 12`` is the whole array)."""
    if index is not None:
        job = agent.db.element(job_id, index)
        if job is None:
            raise missing(agent, job_id, index)
        return [job]
    job = agent.db.get(job_id)
    if job is None:
        raise missing(agent, job_id)
    if job.array_id == job.id:
        return agent.db.array_elements(job.id)
    return [job]


def owner_or_root(agent: Agent, peer: Conn, job: Any, verb: str) -> None:
    owner = job.uid if job.uid is not None else os.getuid()
    if peer.uid in (0, os.getuid(), owner):
        return
    raise PermissionDenied(f"permission denied: {verb!r} of job {job.id} is for its owner "
                           f"({job.user or f'uid {owner}'}) and root only (you are uid "
                           f"{peer.uid})")


def submitter(peer: Conn, user_name: str | None) -> users.User:
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


def abs_path_arg(args: Any, name: str, workdir: str) -> str | None:
    value = arg_str(args, name, optional=True)
    if value is None or value == "":
        return None
    return os.path.normpath(os.path.join(workdir, value))


def expand_paths(job_id: int, name: str, output: str, error: str, user: str, node: str,
                 array_id: int | None = None, array_index: int | None = None,
                 ) -> tuple[str, str]:
    """The output and error names with the job's tokens expanded (``%t`` is left to the
    supervisor, which gives each task its files). Nothing is looked at on disk."""
    values = {"j": str(job_id), "x": name, "u": user, "N": node,
              "A": str(job_id if array_id is None else array_id),
              "a": str(array_index or 0)}
    return outpattern.for_job(output, values), outpattern.for_job(error, values)


def task_paths(out: str, err: str, ntasks: int) -> set[str]:
    """Every file the tasks will write: one pair, or one per task with ``%t``."""
    ranks = range(ntasks) if outpattern.per_task(out) or outpattern.per_task(err) else [0]
    return {outpattern.for_task(p, r) for r in ranks for p in (out, err)}


def sched_args(agent: Agent, args: Any) -> dict[str, Any]:
    """The job_sched facts of a submission: its time limit (the node's default, refused over
    its maximum), its hold and its dependencies (``dependency_refs``)."""
    out: dict[str, Any] = {}
    limit: float | None = None
    if args.get("time_limit") is not None:
        limit = arg_number(args, "time_limit", default=0.0, minimum=0.001,
                           maximum=jobopts.MAX_TIME)
    elif agent.cfg.default_time is not None:
        limit = agent.cfg.default_time
    if limit is not None and agent.cfg.max_time is not None and limit > agent.cfg.max_time:
        raise BadRequest(f"time limit {jobopts.format_time(limit)} is over node "
                         f"{agent.cfg.node}'s maximum of {jobopts.format_time(agent.cfg.max_time)}")
    if limit is not None:
        out["time_limit"] = limit
    if args.get("begin") is not None:
        out["begin_at"] = arg_number(args, "begin", default=0.0, maximum=1e11)
    hold = args.get("hold", False)
    if not isinstance(hold, bool):
        raise BadRequest("argument 'hold' must be true or false")
    if hold:
        out["held"] = True
    text = arg_str(args, "dependency", optional=True, max_len=16384)
    if text:
        out["dependency"] = dependency_refs(agent, text)
    return out


def dependency_refs(agent: Agent, text: str) -> list[tuple[str, int]]:
    """``--dependency`` as the scheduler reads it (schedule.dependency_state): (kind, job id)
    for a job or one element of an array (``ID_INDEX``), (kind, -ID) for every element of
    array ID together (Slurm's array semantics), ("singleton", 0)."""
    try:
        refs = jobopts.parse_dependency(text, jobopts.NODE_KINDS)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    deps: dict[tuple[str, int], None] = {}
    weight = 0  # jobs each pass reads: an array counts each element
    for kind, job, index in dict.fromkeys(refs):
        if kind == "singleton":
            deps[(kind, 0)] = None
            continue
        # ids only (an array's thousand elements are not read whole), and no further than
        # the cap: a hostile list of refs costs at most MAX_DEPENDENCIES lookups' worth
        ids = agent.db.ref_ids(job, index)
        weight += len(ids)
        if index is None and is_array(agent, job):
            deps[(kind, -job)] = None
        else:
            for j in ids:
                deps[(kind, j)] = None
        if weight > MAX_DEPENDENCIES:  # arrays expand: each pass reads every state
            raise BadRequest(f"dependency {text[:60]!r}... names more than "
                             f"{MAX_DEPENDENCIES} jobs (an array counts each element)")
    return list(deps)


def is_array(agent: Agent, job_id: int) -> bool:
    """Is ``job_id`` an array's id (its first element's), rather than a job of its own?"""
    row = agent.db.conn.execute("SELECT array_id FROM job_sched WHERE id = ?",
                                (job_id,)).fetchone()
    return row is not None and row[0] == job_id


def batch_args(args: Any) -> tuple[bytes | None, bool]:
    """A submission's batch script (its bytes, as the command line read them as the user: the
    agent never opens a user's path) and ``slurm_env`` (``--export-slurm-env``)."""
    script = args.get("script")
    if script is not None and (not isinstance(script, bytes) or not script):
        raise BadRequest("argument 'script' must be the script's bytes")
    if script is not None and len(script) > batch.MAX_SCRIPT:
        raise BadRequest(f"the script is {len(script)} bytes, over the limit of "
                         f"{batch.MAX_SCRIPT}")
    slurm_env = args.get("slurm_env", False)
    if not isinstance(slurm_env, bool):
        raise BadRequest("argument 'slurm_env' must be true or false")
    return script, slurm_env


def array_arg(args: Any) -> tuple[list[int], int | None]:
    text = arg_str(args, "array", optional=True, max_len=4096)
    if not text:
        return [], None
    try:
        return jobopts.parse_array(text)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
