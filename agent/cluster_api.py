"""People's requests a cluster member answers for the cluster (I/O: a worker thread of its own).

On a node of a cluster every person's command goes to the local agent's door, as on a lone node:
the kernel says who is asking (``SO_PEERCRED``), and this module answers ``submit``, ``list``,
``show``, ``wait``, ``cancel``, ``hold``, ``release``, ``nodes``, ``drain`` and ``locate`` from
the cluster's database, with the node's own credentials. People never hold those; the identity
written into a job (uid, gid, user, groups) is the kernel's, and ``--user`` is root's alone.

Who may do what is decided here and again in the database (``shared/cluster_funcs.py``): as on
one node, anyone lists and shows; the owner or root waits on, cancels, holds, releases and
locates (the way to inspect, attach to or signal) a job; root drains and resumes nodes.

Nothing here runs on the agent's loop but argument checks and replies: every database call
(and the user lookups and access check of a submission) runs on one worker thread with its own
connection, and its answer comes back through the worker's wakeup fd. A ``wait`` is parked
until the database announces (NOTIFY ``tether_job``) that the job changed, then read again.
"""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg
import zmq

from tether.agent import users
from tether.agent.api import LIST_PAGE, PENDING, paged
from tether.agent.offload import Offload
from tether.agent.request_args import batch_args, owner_or_root, submitter
from tether.shared import cluster_db, jobopts, outpattern, protocol
from tether.shared.cluster_sql import FINAL
from tether.shared.door_conn import Conn
from tether.shared.errors import (
    BadRequest,
    Busy,
    NotFound,
    PermissionDenied,
    StateError,
    TetherError,
    Unavailable,
)
from tether.shared.parking import Lot
from tether.shared.protocol import arg_int, arg_number, check_known

if TYPE_CHECKING:
    from tether.agent.view import ClusterApiAgent as Agent

log = logging.getLogger("tether.agent.cluster")

MAX_HOLD = 600.0
#: what a cluster job carries of a submission
CARRIED = frozenset({"command", "name", "cpus", "gpus", "memory_mb", "ntasks", "output", "error",
                     "workdir", "env", "pmi", "user", "umask", "hold", "requeue", "time_limit",
                     "dependency", "array", "begin", "script", "slurm_env"})
#: submission arguments a cluster job does not carry yet: refused, never silently dropped
NOT_YET: tuple[str, ...] = ()
#: the default output names of a cluster job (its id is the cluster's: no node needed)
DEFAULT_OUTPUT = "tether-%j.out"
DEFAULT_ARRAY_OUTPUT = "tether-%A_%a.out"


def uncarried(args: Any) -> list[str]:
    """The options of a submission a cluster job would drop (named as the CLI spells them)."""
    return [{"time_limit": "--time"}.get(k, "--" + k.replace("_", "-"))
            for k in sorted(args) if k not in CARRIED and args[k] is not None]
#: times a ``wait`` reads its job again when the cluster changed while it read
REREADS = 3
#: requests relayed to other nodes' steps at once (each holds a thread and a connection)
RELAYS = 16
RELAYS_PER_USER = 4


class ClusterRequests:
    def __init__(self, agent: Agent, dsn: str) -> None:
        self.agent = agent
        self.dsn = dsn
        self.worker = Offload(maxsize=64)
        #: the worker's own connection: opened, used and closed on the worker thread only
        self.conn: cluster_db.Conn | None = None
        self.waiters: Lot[int, None] = Lot(agent.timers)
        #: counts the job changes the database announced (a read that began before the
        #: last one may have missed it)
        self.changes = 0
        self.kinds = frozenset(HANDLERS)
        #: relays in flight, per uid
        self.relays: dict[int, int] = {}

    def start(self) -> None:
        fd = self.worker.fileno()
        self.agent.poller.register(fd, zmq.POLLIN)
        self.agent.extra_fds[fd] = self.worker.service

    def close(self) -> None:
        self.worker.submit(self._disconnect, lambda r, e: None, "cluster requests")
        self.worker.close()

    # ---- running a call on the worker ------------------------------------------------------

    def _db(self) -> cluster_db.Conn:
        if self.conn is None or self.conn.closed:
            self.conn = cluster_db.open_checked(self.dsn, application="tether agent requests")
        return self.conn

    def _disconnect(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def run(self, peer: Conn, rid: protocol.RequestId, call: Callable[[cluster_db.Conn], Any],
            then: Callable[[Any], Any] | None = None) -> object:
        """``call(conn)`` on the worker; its result (through ``then``, on the loop) is the
        reply. Errors of the database become one line for the client; the agent goes on."""
        def work() -> Any:
            try:
                return call(self._db())
            except psycopg.Error as exc:
                self._disconnect()
                raise Unavailable(f"the cluster database failed: {cluster_db.one_line(exc)}"
                                  ) from None
            except cluster_db.ClusterUnreachable as exc:
                raise Unavailable(exc.message) from None

        def done(result: Any, exc: BaseException | None) -> None:
            if exc is None and then is not None:
                try:
                    result = then(result)
                except BaseException as err:  # noqa: BLE001 - answered, as the worker's are
                    exc = err
            if result is PENDING and exc is None:
                return
            self.answer(peer, rid, result, exc)
        self.worker.submit(work, done, "cluster requests")
        return PENDING

    def answer(self, peer: Conn, rid: protocol.RequestId, result: Any,
               exc: BaseException | None) -> None:
        if peer.closed:
            return
        if exc is not None:
            if not isinstance(exc, TetherError):
                log.error("cluster request failed: %s", exc, exc_info=exc)
                exc = TetherError("internal error")
            self.agent.reply(peer, protocol.error(rid, exc))
        else:
            self.agent.reply(peer, protocol.ok(rid, result))

    # ---- the requests ----------------------------------------------------------------------

    def dispatch(self, peer: Conn, req: protocol.Request) -> Any:
        """Answer ``req`` (a kind of ``HANDLERS``): a reply, or PENDING for one that comes
        from the worker."""
        if req.kind == "list" and req.args.get("local"):  # this node's own runs (top)
            from tether.agent import api

            return api.list_jobs(self.agent, peer, req)
        handler = HANDLERS[req.kind]
        if req.args.get("index") is not None:
            raise BadRequest("cluster jobs have no array elements (ID_INDEX)")
        return handler(self, peer, req)

    def submit(self, peer: Conn, req: protocol.Request) -> Any:
        from tether.agent.api import submission_args

        args = req.args
        sub = submission_args(args, req.kind, extra=("requeue", "script", "slurm_env"))
        dropped = uncarried(args)
        if dropped:
            raise BadRequest(f"{', '.join(dropped)} not supported for cluster jobs yet")
        requeue = args.get("requeue")  # None: the cluster's default (cluster init)
        if requeue is not None and not isinstance(requeue, bool):
            raise BadRequest("argument 'requeue' must be true or false")
        workdir = sub["workdir"]
        script, slurm_env = batch_args(args)  # a batch script's bytes, read by the CLI as her
        sched = scheduling(args)
        array = sched.get("array")
        output = sub["output"] or os.path.join(workdir, DEFAULT_ARRAY_OUTPUT if array
                                               else DEFAULT_OUTPUT)
        error = sub["error"] or output

        def check(deadline: float, timeout: float) -> users.User:
            """As on one node (checks.py: a thread of its own, bounded per user and in time):
            who the user is, and whether she can enter the workdir and write the outputs."""
            user = submitter(peer, sub["user"])
            values = {"x": sub["name"], "u": user.name}
            probe = [outpattern.for_job(p, dict(values, j="0", A="0", a="0"))
                     for p in (output, error)]
            if user.uid == os.geteuid():
                users.check_own_access(workdir, probe)
            else:
                users.check_access(user, workdir, probe, timeout=timeout, deadline=deadline)
            return user

        def checked(user: users.User | None, exc: BaseException | None) -> None:
            if peer.closed:
                return
            if exc is not None or user is None:
                self.answer(peer, req.id, None, exc or TetherError("internal error"))
                return
            try:
                self.run(peer, req.id, lambda conn: call(conn, user))
            except TetherError as err:  # the worker's queue is full
                self.answer(peer, req.id, None, err)

        def call(conn: cluster_db.Conn, user: users.User) -> Any:
            # %j, %A and %a once the ids are given; %N when a node claims it
            values = {"x": sub["name"], "u": user.name}
            fields = {"name": sub["name"], "command": sub["command"],
                      "cpus_per_task": sub["cpus"], "ntasks": sub["ntasks"],
                      "gpus_req": sub["gpus"], "memory_mb": sub["memory_mb"],
                      "workdir": workdir, "env": sub["env"], "pmi": sub["pmi"],
                      "username": user.name, "uid": user.uid, "gid": user.gid,
                      "groups": list(user.groups), "requeue": requeue,
                      "held": sub["hold"], "umask": sub["umask"], "output": output,
                      "error": error, "slurm_env": slurm_env, **sched}
            if script is not None:  # bytea, from base64 (JSON has no bytes)
                fields["script"] = base64.b64encode(script).decode()

            def expand(job: int, index: int | None, first: int | None) -> tuple[str, str]:
                v = dict(values, j=str(job), A=str(first or job), a=str(index or 0))
                return outpattern.for_job(output, v), outpattern.for_job(error, v)
            return cluster_db.submit(conn, fields, expand)
        self.agent.checks.start(peer, sub["user"], check, checked)
        return PENDING

    def list_jobs(self, peer: Conn, req: protocol.Request) -> Any:
        check_known(req.args, req.kind, ("after", "limit", "local"))
        after = arg_int(req.args, "after", default=0, minimum=0)
        limit = arg_int(req.args, "limit", default=LIST_PAGE, minimum=1, maximum=LIST_PAGE)

        return self.run(peer, req.id, lambda c: cluster_db.list_jobs(c, after, limit + 1),
                        lambda jobs: paged(jobs, limit, False))

    def show(self, peer: Conn, req: protocol.Request) -> Any:
        check_known(req.args, req.kind, ("job", "index"))
        job = arg_int(req.args, "job", minimum=1)
        return self.run(peer, req.id, lambda c: cluster_db.get_job(c, job))

    def wait(self, peer: Conn, req: protocol.Request, rereads: int = REREADS) -> Any:
        check_known(req.args, req.kind, ("job", "hold", "index"))
        job = arg_int(req.args, "job", minimum=1)
        hold = arg_number(req.args, "hold", default=30.0, maximum=MAX_HOLD)
        seen = self.changes

        def decide(row: dict[str, Any]) -> Any:
            owner_or_root(self.agent, peer, _Owner(row), "wait")
            if row["state"] in FINAL:
                return {"done": True, "job": row}
            if self.changes != seen and rereads > 0:  # it may have ended while we read
                return self.wait(peer, req, rereads - 1)
            self.waiters.park(job, peer, req.id, hold, None, lambda p: self.answer(
                p.peer, p.rid, {"done": False}, None))
            return PENDING
        return self.run(peer, req.id, lambda c: cluster_db.get_job(c, job), decide)

    def job_changed(self, job: int) -> None:
        """The database announced a change of ``job``: its parked waits read it again."""
        self.changes += 1
        parked = self.waiters.take(job)
        if not parked:
            return

        def woke(row: Any, exc: BaseException | None) -> None:
            for p in parked:
                if exc is not None:
                    self.answer(p.peer, p.rid, None, exc)
                elif row["state"] in FINAL:
                    self.answer(p.peer, p.rid, {"done": True, "job": row}, None)
                else:  # not over yet: the rest of the hold is not worth tracking; ask again
                    self.answer(p.peer, p.rid, {"done": False}, None)
        try:
            self.worker.submit(lambda: cluster_db.get_job(self._db(), job), woke,
                               "cluster requests")
        except TetherError as exc:
            woke(None, exc)

    def cancel(self, peer: Conn, req: protocol.Request) -> Any:
        check_known(req.args, req.kind, ("job", "index"))
        job = arg_int(req.args, "job", minimum=1)
        return self.run(peer, req.id, lambda c: cluster_db.cancel(c, job, _uid(peer)))

    def hold(self, peer: Conn, req: protocol.Request) -> Any:
        check_known(req.args, req.kind, ("job", "index"))
        job = arg_int(req.args, "job", minimum=1)
        held = req.kind == "hold"

        def call(conn: cluster_db.Conn) -> Any:
            cluster_db.hold(conn, job, _uid(peer), held)
            return {"jobs": [job]}
        return self.run(peer, req.id, call)

    def nodes(self, peer: Conn, req: protocol.Request) -> Any:
        check_known(req.args, req.kind, ())
        return self.run(peer, req.id, cluster_db.list_nodes)

    def drain(self, peer: Conn, req: protocol.Request) -> Any:
        check_known(req.args, req.kind, ("node", "drain"))
        node = protocol.arg_str(req.args, "node", max_len=63)
        drain = req.args.get("drain", True)
        if not isinstance(drain, bool):
            raise BadRequest("argument 'drain' must be true or false")
        if _uid(peer) != 0:  # said here too, so the words are the same with no database
            raise PermissionDenied(f"permission denied: draining and resuming nodes is for "
                                   f"root only (you are uid {peer.uid})")

        def call(conn: cluster_db.Conn) -> Any:
            cluster_db.set_drain(conn, str(node), drain, 0)
            return {"node": node, "drain": drain}
        return self.run(peer, req.id, call)

    def locate(self, peer: Conn, req: protocol.Request) -> Any:
        """Where a job's current attempt runs (node, host, state dir, the node's own job id),
        for its owner or root: how ``inspect``, ``attach`` and ``signal`` find its supervisor."""
        check_known(req.args, req.kind, ("job", "verb"))
        job = arg_int(req.args, "job", minimum=1)
        verb = protocol.arg_str(req.args, "verb", default="inspect", max_len=32)

        def check(at: dict[str, Any]) -> Any:
            owner_or_root(self.agent, peer, _Owner(at), str(verb))
            return {k: at[k] for k in ("id", "state", "node", "host", "state_dir",
                                       "local_job", "attempt")}
        return self.run(peer, req.id, lambda c: cluster_db.where(c, job), check)

    def relay(self, peer: Conn, req: protocol.Request) -> Any:
        """A request to a cluster job's step wherever it runs (``inspect``, ``attach``,
        ``signal``, ``suspend``, ``resume`` from any node), asked through the database of the
        node that runs it (``cluster_relay.py``). On a thread of its own: it waits."""
        from tether.agent import cluster_relay
        from tether.shared.cluster_funcs import ASK_KINDS

        check_known(req.args, req.kind, ("job", "kind", "args"))
        job = arg_int(req.args, "job", minimum=1)
        kind = protocol.arg_str(req.args, "kind", max_len=32)
        if kind not in ASK_KINDS:
            raise BadRequest(f"'relay' of {kind!r}: only {', '.join(ASK_KINDS)}")
        args = req.args.get("args") or {}
        if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
            raise BadRequest("'relay' args must be a map")
        uid = _uid(peer)
        if self.relays.get(uid, 0) >= RELAYS_PER_USER or sum(self.relays.values()) >= RELAYS:
            raise Busy(f"the agent is relaying {RELAYS_PER_USER} of your requests (or "
                       f"{RELAYS} in all) already; try again")
        self.relays[uid] = self.relays.get(uid, 0) + 1

        def done(result: Any, exc: BaseException | None) -> None:
            self.relays[uid] -= 1
            if not self.relays[uid]:
                del self.relays[uid]
            if isinstance(exc, (psycopg.Error, cluster_db.ClusterUnreachable)):
                exc = Unavailable(f"the cluster database failed: {exc}")
            self.answer(peer, req.id, result, exc)
        self.agent.offload.aside(
            lambda: cluster_relay.ask(self.dsn, job, uid, str(kind), dict(args)), done,
            "tether-ask")
        return PENDING

    def acct(self, peer: Conn, req: protocol.Request) -> Any:
        """The cluster's accounting (``tether acct`` on a member): its ended jobs, with what
        each step used as its node reported it; ``local`` for this node's own history."""
        from tether.agent import api

        args = dict(req.args)
        if args.pop("local", False):
            return api.acct_jobs(self.agent, peer, protocol.Request(
                id=req.id, kind=req.kind, args=args, v=req.v))
        a = api.acct_args(args, req.kind)
        limit = a["limit"]

        def query(conn: cluster_db.Conn) -> Any:
            return cluster_db.acct(conn, after=a["after"], limit=limit + 1, refs=a["refs"],
                                   users=a["lists"]["users"], states=a["lists"]["states"],
                                   names=a["lists"]["names"], since=a["since"],
                                   until=a["until"], uid=peer.uid if a["mine"] else None)

        return self.run(peer, req.id, query, lambda rows: paged(rows, limit, False))

    def on_node(self, peer: Conn, req: protocol.Request) -> Any:
        """``suspend`` and ``resume`` of a cluster job: the node's own job if it runs here, else
        asked of its node (the owner or root)."""
        from tether.agent import api
        from tether.agent.cluster_local import current_run

        check_known(req.args, req.kind, ("job", "index"))
        job = arg_int(req.args, "job", minimum=1)
        run = current_run(self.agent.db.conn, job)
        if run is not None:
            local = protocol.Request(id=req.id, kind=req.kind,
                                     args=dict(req.args, job=run.local_job), v=req.v)
            return api.HANDLERS[req.kind](self.agent, peer, local)

        def elsewhere(at: dict[str, Any]) -> Any:
            owner_or_root(self.agent, peer, _Owner(at), req.kind)
            if at["node"] is None:
                raise StateError(f"job {job} is {at['state']}: it runs on no node")
            # its node's agent does it: asked through the database (cluster_relay.py)
            relayed = protocol.Request(id=req.id, kind="relay", args={
                "job": job, "kind": req.kind, "args": {}}, v=req.v)
            return self.relay(peer, relayed)
        return self.run(peer, req.id, lambda c: cluster_db.where(c, job), elsewhere)


def scheduling(args: Any) -> dict[str, Any]:
    """A cluster submission's scheduling facts, checked: time limit, begin, dependency (as
    (kind, job, index) for the database to resolve) and array (indices, throttle)."""
    out: dict[str, Any] = {}
    if args.get("time_limit") is not None:
        out["time_limit"] = arg_number(args, "time_limit", default=0.0, minimum=0.001,
                                       maximum=jobopts.MAX_TIME)
    if args.get("begin") is not None:
        out["begin_at"] = arg_number(args, "begin", default=0.0, maximum=1e11)
    text = protocol.arg_str(args, "dependency", optional=True, max_len=16384)
    if text:
        try:
            out["dependency"] = [list(d) for d in jobopts.parse_dependency(
                text, jobopts.NODE_KINDS)]
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    text = protocol.arg_str(args, "array", optional=True, max_len=4096)
    if text:
        try:
            indices, most = jobopts.parse_array(text)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        out["array"] = {"indices": indices, "max": most}
    return out


class _Owner:
    """A cluster row as ``owner_or_root`` reads a job."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.id = row["id"]
        self.uid = row["uid"]
        self.user = row.get("user") or row.get("username")
        if self.uid is None:
            raise NotFound(f"job {self.id} names no user")


def _uid(peer: Conn) -> int:
    """The uid the database is told: root's powers for root and for the agent's own user, as
    ``owner_or_root`` grants them on one node."""
    return 0 if peer.uid in (0, os.getuid()) else int(peer.uid)


HANDLERS: dict[str, Callable[[ClusterRequests, Conn, protocol.Request], Any]] = {
    "submit": ClusterRequests.submit, "list": ClusterRequests.list_jobs,
    "show": ClusterRequests.show, "wait": ClusterRequests.wait,
    "cancel": ClusterRequests.cancel, "hold": ClusterRequests.hold,
    "release": ClusterRequests.hold, "nodes": ClusterRequests.nodes,
    "drain": ClusterRequests.drain, "locate": ClusterRequests.locate,
    "suspend": ClusterRequests.on_node, "resume": ClusterRequests.on_node,
    "relay": ClusterRequests.relay, "acct": ClusterRequests.acct,
}
