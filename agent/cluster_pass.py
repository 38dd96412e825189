"""One pass of a cluster member with the database, on the cluster's worker thread (I/O).

The agent's loop never talks to PostgreSQL (``cluster.py``): it takes a ``Snapshot`` of what it
knows (its open runs, their results, what it has free), hands it to ``Passes.run`` on a worker
thread of its own, and applies the ``Outcome`` when it comes back. A pass is: join (connect,
LISTEN, register) or heartbeat; declare dead nodes down; read which attempts the database says
this node runs; deliver finished results and report starts; queue again the claims this node
never recorded; mark the node up after a rejoin; claim work that fits. Every statement is one
call of a function of ``shared/cluster_funcs.py``, bounded by the connection's timeouts, so a
pass ends (or raises) in bounded time and the loop is never held meanwhile.

The connection this thread uses is its own; the LISTEN connection it opens is handed to the
loop, which only reads notifications from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg

from tether.agent import cluster_db
from tether.shared import cluster_db as shared_db
from tether.shared import lease
from tether.shared.cluster_sql import CHANNEL_ASK, CHANNEL_JOB, CHANNEL_QUEUE

Key = tuple[int, int]  # (cluster job, attempt)


@dataclass
class Snapshot:
    """What the loop knows, for one pass (taken on the loop)."""

    #: the pass must (re)join: connect, register
    join: bool
    #: this agent has beaten on time for longer than the timeout: it may judge others
    may_reap: bool
    #: (local job, cluster job, attempt, result) of every open run that ended here
    results: list[tuple[int, int, int, dict[str, Any]]] = field(default_factory=list)
    #: the start of every open run that runs here, to report where the database says starting
    running: dict[Key, dict[str, Any]] = field(default_factory=dict)
    #: every attempt this node has recorded and not discarded
    known: set[Key] = field(default_factory=set)
    #: claimed rows this node cannot run: (cluster job, attempt, why)
    failures: list[tuple[int, int, str]] = field(default_factory=list)
    #: what it may claim (CPUs, GPUs, MB), or None: no claim this pass
    free: tuple[int, int, int] | None = None
    #: why this node drains itself (it could not start its jobs), or None
    drain: str | None = None


@dataclass
class Outcome:
    """What the pass did and learnt (applied on the loop)."""

    #: when the database last confirmed this node (lease time), None if it did not
    sent: float | None = None
    #: how the node was found when it (re)joined: new, down or up; None: no join
    was: str | None = None
    #: up, draining, down, taken (another agent has the node) or not_up (rejoin next)
    state: str = "up"
    timeout: float = 30.0
    reaped: list[dict[str, Any]] = field(default_factory=list)
    #: the attempts the database says run here, by key: their rows
    current: dict[Key, dict[str, Any]] = field(default_factory=dict)
    #: (local job, cluster job, attempt, refusal or None, state) per result delivered
    reported: list[tuple[int, int, int, str | None, str]] = field(default_factory=list)
    requeued: list[tuple[int, int, str]] = field(default_factory=list)
    claimed: list[dict[str, Any]] = field(default_factory=list)
    #: a new LISTEN connection for the loop to poll
    listener: shared_db.Conn | None = None
    #: the node drained itself (Snapshot.drain)
    drained: bool = False


class Passes:
    """The worker's side: its connection and the pass."""

    def __init__(self, dsn: str, info: cluster_db.NodeInfo) -> None:
        self.dsn = dsn
        self.info = info
        self.conn: shared_db.Conn | None = None

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except psycopg.Error:
                pass
            self.conn = None

    def run(self, snap: Snapshot) -> Outcome:
        try:
            return self._run(snap)
        except BaseException:
            self.close()  # the next pass joins anew
            raise

    def _run(self, snap: Snapshot) -> Outcome:
        out = Outcome()
        info = self.info
        if snap.join or self.conn is None:
            self.close()
            app = f"tether-agent {info.name}"
            self.conn = shared_db.open_checked(self.dsn, application=app)
            listener = shared_db.open_checked(self.dsn, application=app + " listen")
            try:
                shared_db.listen(listener, CHANNEL_QUEUE, CHANNEL_JOB, CHANNEL_ASK)
            except BaseException:
                listener.close()
                raise
            out.listener = listener
            out.sent = lease.now()  # registering stamps the heartbeat no earlier than this
            out.was = cluster_db.register(self.conn, info)
            out.state = "up" if out.was == "up" else "down"
        else:
            sent = lease.now()
            out.state = cluster_db.heartbeat(self.conn, info)
            if out.state == "taken":
                return out
            out.sent = sent
            if out.state == "down":  # declared down while away: rejoin (reconciled by the loop)
                out.sent = lease.now()
                out.was = cluster_db.register(self.conn, info)
        conn = self.conn
        out.timeout = shared_db.heartbeat_timeout(conn)
        if snap.may_reap and out.was is None:
            out.reaped = cluster_db.reap(conn)
        out.current = {(r["id"], r["attempt"]): r for r in cluster_db.my_jobs(conn, info.name)}
        for local, cj, attempt, result in snap.results:
            refused = cluster_db.report(conn, cj, attempt, result)
            out.reported.append((local, cj, attempt, refused, str(result["state"])))
        for key, fields in snap.running.items():
            row = out.current.get(key)
            if row is not None and row["state"] == "starting":
                cluster_db.set_running(conn, key[0], key[1], int(fields["local_job"]), fields)
        for cj, attempt, why in snap.failures:
            cluster_db.report(conn, cj, attempt, {"state": "failed", "exit_code": None,
                                                  "signal": None, "reason": f"cannot run: {why}"})
        for cj, attempt in out.current:
            if (cj, attempt) not in snap.known:
                why = (f"node {info.name} never started attempt {attempt} (its claim was not "
                       "recorded locally); queued again")
                if cluster_db.requeue_unknown(conn, cj, attempt, why):
                    out.requeued.append((cj, attempt, why))
        if out.was in ("new", "down"):
            cluster_db.mark_up(conn, info)
            out.state = "up"
        if snap.drain is not None:  # it cannot start jobs: it takes no more (root's power)
            shared_db.set_drain(conn, info.name, True, 0)
            out.drained = True
            out.state = "draining"
        if out.state in ("up", "draining") and snap.free is not None and not info.login:
            claimed = cluster_db.claim(conn, info, snap.free)
            if claimed is None:
                out.state = "not_up"
            else:
                out.claimed = claimed
        return out

    def leave_if_idle(self) -> bool:
        """At the agent's stop: the node goes down unless the database says it runs something."""
        if self.conn is None:
            return False
        return cluster_db.leave_if_idle(self.conn, self.info)
