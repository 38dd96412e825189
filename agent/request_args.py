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
from tether.shared import jobopts, outpattern
from tether.shared.door_conn import Conn
from tether.shared.errors import BadRequest, NotFound, PermissionDenied
from tether.shared.protocol import arg_int, arg_number, arg_str

if TYPE_CHECKING:
    from tether.agent.daemon import Agent

#: Jobs one submission may depend on, arrays counted element by element.
MAX_DEPENDENCIES = 1000


def job_arg(agent: Agent, args: Any) -> Any:
    job_id = arg_int(args, "job", minimum=1)
    job = agent.db.get(job_id)
    if job is None:
        raise NotFound(f"no job {job_id}")
    return job


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
            raise NotFound(f"no job {job_id}_{index}")
        return [job]
    job = agent.db.get(job_id)
    if job is None:
        raise NotFound(f"no job {job_id}")
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
    its maximum), its hold and its dependencies (resolved to job ids, arrays to their
    elements)."""
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
        try:
            refs = jobopts.parse_dependency(text)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        deps: dict[tuple[str, int], None] = {}
        for kind, job, index in dict.fromkeys(refs):
            # ids only (an array's thousand elements are not read whole), and no further than
            # the cap: a hostile list of refs costs at most MAX_DEPENDENCIES lookups' worth
            for j in agent.db.ref_ids(job, index):
                deps[(kind, j)] = None
            if len(deps) > MAX_DEPENDENCIES:  # arrays expand: each pass reads every state
                raise BadRequest(f"dependency {text[:60]!r}... names more than "
                                 f"{MAX_DEPENDENCIES} jobs (an array counts each element)")
        out["dependency"] = list(deps)
    return out


def array_arg(args: Any) -> tuple[list[int], int | None]:
    text = arg_str(args, "array", optional=True, max_len=4096)
    if not text:
        return [], None
    try:
        return jobopts.parse_array(text)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
