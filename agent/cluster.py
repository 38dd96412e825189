"""A node agent as a member of a cluster (I/O): the glue between the agent's loop and PostgreSQL.

Theory of operation. The agent runs exactly as standalone: its SQLite is the record of what runs
here, its scheduler starts local pending jobs, supervisors are followed as always. This module
only (1) turns cluster claims into local pending jobs, (2) reports local results back, and
(3) keeps the node's membership: heartbeats, declaring dead nodes down, reconciling.

Everything happens on the agent's one event loop. The database connection's socket sits in the
loop's poller (LISTEN/NOTIFY wakes it: a submit, freed resources, a cancel); a timer beats every
``heartbeat`` seconds. Each database call is a short transaction with bounded waits
(``shared/cluster_db.py``); the loop never waits on another agent's locks.

Races and their answers:
- Claim vs crash: the local job and its link row are inserted in a local transaction that
  commits only after the cluster's claim committed. A crash in between leaves a cluster claim
  with no local job, which the next reconcile puts back in the queue (it never ran).
- Result vs node declared down: ``report`` checks the current attempt in the transaction that
  writes the result; a stale result is refused and dropped.
- Database unreachable: running jobs go on; results stay in the local outbox (``cluster_local``)
  and are delivered when it returns; no new work is claimed meanwhile.
- Database back after an outage: every heartbeat in the cluster looks stale. An agent may declare
  a node down only after it has itself been connected and heartbeating for longer than the
  timeout (so every live node has had the time to beat again).
- A node that was declared down (stopped, partitioned, slow) and comes back reconciles before it
  claims anything: every local run whose attempt is no longer current is killed and its result
  discarded; every result of a current attempt is reported.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
import zmq

import tether
from tether.agent import cluster_db, cluster_local, lifecycle_effects
from tether.agent.job import FINAL, Job
from tether.shared import cluster_db as shared_db
from tether.shared import lease, records
from tether.shared.cluster_sql import CHANNEL_JOB, CHANNEL_QUEUE, demand
from tether.shared.errors import TetherError
from tether.shared.timers import rfc3339_now

if TYPE_CHECKING:
    from tether.agent.daemon import Agent

log = logging.getLogger("tether.agent.cluster")


@dataclass(frozen=True)
class ClusterConfig:
    #: the node's own connection string (its role and password): never logged, never shown
    dsn: str = field(repr=False)
    #: seconds between heartbeats
    heartbeat: float = 2.0
    #: a login node: serves its users' requests and the cluster, owns no resources
    login: bool = False


class ClusterNode:
    def __init__(self, agent: Agent, cfg: ClusterConfig) -> None:
        self.agent = agent
        self.cfg = cfg
        self.conn: shared_db.Conn | None = None
        self.fd: int | None = None
        login = cfg.login
        self.info = cluster_db.NodeInfo(
            name=agent.cfg.node, host=socket.gethostname(), state_dir=agent.cfg.state_dir,
            cpus=0 if login else len(agent.ledger.cpu_ids),
            gpus=0 if login else len(agent.ledger.gpu_ids),
            memory_mb=0 if login else agent.ledger.memory_mb, version=tether.__version__,
            session=secrets.token_hex(8), login=login)
        self.timeout = 30.0
        #: monotonic time since which this agent has been connected and beating on time
        self.healthy_since: float | None = None
        self.last_beat = 0.0
        #: ``up``, ``draining``, ``down`` (reconciling) or ``offline`` (no database)
        self.state = "offline"
        #: local jobs already told to stop (a cancel, or a stale attempt)
        self.stopping_local: set[int] = set()
        self.warned = False
        #: the database's last refusal, logged once
        self.refused = ""
        #: the local table exists (results finalized by the reattach before ``start`` are
        #: delivered by the outbox flush when the node joins)
        self.ready = False

    # ---- the agent's hooks -----------------------------------------------------------------

    def start(self) -> None:
        """Before the agent serves: set the local table up, join if the database answers."""
        db = self.agent.db
        cluster_local.ensure(db.conn)
        self.ready = True
        # tells this node's CLI that job ids are the cluster's (inspect asks where one runs)
        records.atomic_write_json(self.agent.layout.cluster_marker, {
            "schema": records.SCHEMA, "node": self.info.name, "login": self.info.login})
        for run, state in cluster_local.open_runs(db.conn):
            if state == "pending":  # claimed in the very loop turn the last agent died in
                self.stop_local(run, "abandoned at an agent restart before it started; the "
                                "cluster queues it again", discard=True)
        self.guarded(self.join)
        self.agent.timers.at(time.monotonic() + self.cfg.heartbeat, self.tick)

    def stop(self) -> None:
        """The agent is stopping: an idle node leaves the cluster, a busy one stays ``up``."""
        if self.conn is None:
            return
        busy = bool(self.agent.db.in_states("starting", "running"))
        owed = any(state in FINAL for _, state in cluster_local.open_runs(self.agent.db.conn))
        try:
            if not busy and not owed and cluster_db.leave_if_idle(self.conn, self.info):
                log.info("node %s is down: its agent stopped while idle", self.info.name)
            else:
                log.info("node %s stays up: its jobs keep running and a restart within %gs "
                         "loses nothing", self.info.name, self.timeout)
        except psycopg.Error as exc:
            log.warning("could not tell the cluster this agent stops: %s", shared_db.one_line(exc))
        self.disconnect()

    def job_ended(self, job: Job) -> None:
        """A local job reached a final state: its result is owed (delivered off this stack)."""
        if self.ready and cluster_local.get(self.agent.db.conn, job.id) is not None:
            self.agent.timers.at(0.0, lambda: self.guarded(self.flush))

    def job_running(self, job: Job) -> None:
        if not self.ready:
            return  # reconcile reports it once the node joins
        run = cluster_local.get(self.agent.db.conn, job.id)
        if run is not None and run.status == "open" and self.conn is not None:
            self.guarded(lambda: self.report_running(run, job))

    # ---- the loop's events -----------------------------------------------------------------

    def tick(self) -> None:
        """The heartbeat: beat (or reconnect), declare dead nodes down, reconcile, claim."""
        try:
            if self.conn is None:
                self.guarded(self.join)
            else:
                self.guarded(self.beat)
        finally:
            self.agent.timers.at(time.monotonic() + self.cfg.heartbeat, self.tick)

    def readable(self) -> None:
        self.guarded(self.on_notifies)

    def on_notifies(self) -> None:
        assert self.conn is not None
        claim = sync = False
        for _ in range(8):  # bounded: notifies that arrive while we act are taken next round
            got = list(self.conn.notifies(timeout=0))
            if not got:
                break
            for n in got:
                if n.channel == CHANNEL_QUEUE:
                    claim = True
                elif n.channel == CHANNEL_JOB:
                    sync = True
                    if n.payload.isdigit() and self.agent.cluster_requests is not None:
                        self.agent.cluster_requests.job_changed(int(n.payload))
            if sync:
                self.reconcile()
            if claim:
                self.claim()
            claim = sync = False

    # ---- membership ------------------------------------------------------------------------

    def guarded(self, action: Callable[[], None]) -> None:
        """Run one database action; a failure of the database never stops the agent."""
        try:
            action()
        except (psycopg.Error, shared_db.ClusterUnreachable) as exc:
            if lease.refused(exc):
                # Stopped or restarting for everyone: nobody can requeue anything meanwhile,
                # so this node's steps go on (shared/lease.py); silence is not this.
                self.renew(lease.now())
            if not self.warned:
                why = exc.message if isinstance(exc, shared_db.ClusterError) else \
                    shared_db.one_line(exc)
                log.warning("cluster database unreachable or failing (%s): jobs keep running, "
                            "results are kept locally and delivered when it returns; no new "
                            "work meanwhile", why)
                self.warned = True
            self.disconnect()
        except TetherError as exc:  # refused: not a node's login, another agent has the node
            if exc.message != self.refused:  # said once, not at every heartbeat
                log.error("cluster: %s", exc.message)
                self.refused = exc.message
            self.disconnect()

    def disconnect(self) -> None:
        if self.fd is not None:
            self.agent.extra_fds.pop(self.fd, None)
            try:
                self.agent.poller.unregister(self.fd)
            except KeyError:
                pass
            self.fd = None
        if self.conn is not None:
            try:
                self.conn.close()
            except psycopg.Error:
                pass
            self.conn = None
        self.state = "offline"
        self.healthy_since = None

    def join(self) -> None:
        """Connect, listen, register, reconcile both ways, deliver the outbox, then take work."""
        conn = shared_db.open_checked(self.cfg.dsn, application=f"tether-agent {self.info.name}")
        self.conn = conn
        self.fd = conn.fileno()
        self.agent.poller.register(self.fd, zmq.POLLIN)
        self.agent.extra_fds[self.fd] = self.readable
        shared_db.listen(conn, CHANNEL_QUEUE, CHANNEL_JOB)
        self.timeout = shared_db.heartbeat_timeout(conn)
        was = cluster_db.register(conn, self.info)  # "new", "down" or "up"
        self.refused = ""
        if self.warned:
            log.info("cluster database reachable again")
            self.warned = False
        self.state = "up" if was == "up" else "down"
        self.healthy_since = self.last_beat = time.monotonic()
        sent = lease.now()  # the registration stamped the heartbeat no earlier than this
        self.reconcile()
        self.flush()
        if was != "up":
            cluster_db.mark_up(conn, self.info)
            self.state = "up"
        self.renew(sent)  # after the reconcile: a stale run is stopped, not given more time
        if was == "down":
            log.info("node %s rejoined the cluster after reconciling", self.info.name)
        else:
            log.info("node %s joined the cluster%s (heartbeat %gs, timeout %gs)", self.info.name,
                     " as a login node" if self.info.login else "", self.cfg.heartbeat,
                     self.timeout)
        self.claim()

    def beat(self) -> None:
        assert self.conn is not None
        now = time.monotonic()
        if now - self.last_beat > self.timeout:
            # We were stopped or starved for longer than the timeout: others may have declared
            # us down, and we cannot judge their heartbeats until we have beaten on time again.
            self.healthy_since = now
        sent = lease.now()
        state = cluster_db.heartbeat(self.conn, self.info)
        self.last_beat = now
        if state == "taken":
            log.error("node %s was registered by another agent: this one leaves the cluster",
                      self.info.name)
            self.disconnect()
            return
        if state == "down":
            log.warning("node %s was declared down while this agent was away: reconciling "
                        "before taking any work", self.info.name)
            self.disconnect()
            self.join()
            return
        self.state = state
        self.renew(sent)
        assert self.healthy_since is not None
        if now - self.healthy_since > self.timeout:
            for done in cluster_db.reap(self.conn):
                log.warning("%s: requeued jobs %s, failed jobs %s", done["reason"],
                            done["requeued"], done["failed"])
        self.reconcile()
        self.flush()
        self.claim()

    def renew(self, sent: float) -> None:
        """The node is in the cluster as of ``sent``: its steps' lease goes on."""
        try:
            lease.write(self.agent.layout.cluster_lease, sent, self.timeout, self.info.name)
        except OSError as exc:  # its steps fence themselves in time: say why
            log.error("cannot renew the lease in %s: %s", self.agent.layout.cluster_lease, exc)

    def fence_spec(self, local_job: int) -> dict[str, Any] | None:
        """What a step run for the cluster needs to fence itself (launcher.spec_of)."""
        if not self.ready or cluster_local.get(self.agent.db.conn, local_job) is None:
            return None
        return {"lease": self.agent.layout.cluster_lease, "after": self.timeout}

    # ---- reconciling -----------------------------------------------------------------------

    def reconcile(self) -> None:
        """Compare what runs here with what the cluster says runs here, both ways."""
        assert self.conn is not None
        db = self.agent.db
        current = {(r["id"], r["attempt"]): r for r in cluster_db.my_jobs(self.conn,
                                                                           self.info.name)}
        for run, _ in cluster_local.open_runs(db.conn):
            row = current.get((run.cluster_job, run.attempt))
            job = db.get(run.local_job)
            if job is None or job.final:
                continue  # the outbox reports it (or has it refused)
            if row is None:
                self.stop_local(run, f"cluster job {run.cluster_job} attempt {run.attempt} is "
                                "no longer this node's (it was requeued or ended elsewhere)",
                                discard=True)
            elif row["cancel_requested"]:
                self.stop_local(run, "cancelled", discard=False)
            elif job.state == "running" and row["state"] == "starting":
                self.report_running(run, job)
        for cj, attempt in current:
            found = cluster_local.find(db.conn, cj, attempt)
            if found is None or found.status == "discarded":
                why = (f"node {self.info.name} never started attempt {attempt} (its claim was "
                       "not recorded locally); queued again")
                if cluster_db.requeue_unknown(self.conn, cj, attempt, why):
                    log.warning("cluster job %d: %s", cj, why)

    def stop_local(self, run: cluster_local.Run, why: str, *, discard: bool) -> None:
        db = self.agent.db
        if discard:
            cluster_local.set_status(db.conn, run.local_job, "discarded")
        job = db.get(run.local_job)
        if job is None or job.final or (job.id in self.stopping_local and not discard):
            return
        self.stopping_local.add(job.id)
        log.warning("local job %d (cluster job %d attempt %d): %s; stopping it%s", job.id,
                    run.cluster_job, run.attempt, why, " and discarding its result"
                    if discard else "")
        if job.state == "pending":
            self.agent.job_ended(self.agent.finalize(job.id, lifecycle_effects.Finalize(
                state="cancelled", reason=why)))
            return
        job = db.change(job, cancel_requested=True)  # durable before anything is sent
        self.agent.cancel(job)  # as `tether cancel` does: the job's machine stops it

    def report_running(self, run: cluster_local.Run, job: Job) -> None:
        assert self.conn is not None
        cluster_db.set_running(self.conn, run.cluster_job, run.attempt, run.local_job, {
            "started_at": job.started_at, "cpus": job.cpus, "gpus": job.gpus, "pids": job.pids,
            "supervisor_pid": job.supervisor_pid})

    def flush(self) -> None:
        """Deliver the outbox: every final local result of an open attempt, exactly once."""
        if self.conn is None:
            return
        db = self.agent.db
        for run, state in cluster_local.open_runs(db.conn):
            job = db.get(run.local_job)
            if job is None or state not in FINAL:
                continue
            result: dict[str, Any] = {
                "state": job.state, "exit_code": job.exit_code, "signal": job.signal,
                "reason": job.reason, "started_at": job.started_at, "ended_at": job.ended_at,
                "pids": job.pids, "supervisor_pid": job.supervisor_pid, "cpus": job.cpus,
                "gpus": job.gpus, "local_job": job.id,
                # the node's loss, not the job's failure: requeued or node_fail (lease.py)
                "fenced": job.state == "failed" and (job.reason or "").startswith(
                    lease.FENCED)}
            refused = cluster_db.report(self.conn, run.cluster_job, run.attempt, result)
            # After the cluster's commit: a crash before this line reports again, and the
            # cluster refuses the repeat because the job is no longer active.
            cluster_local.set_status(db.conn, run.local_job,
                                     "reported" if refused is None else "refused")
            if refused is None:
                log.info("cluster job %d attempt %d: result delivered (%s)", run.cluster_job,
                         run.attempt, job.state)
            else:
                log.warning("cluster job %d attempt %d: result refused and dropped: %s",
                            run.cluster_job, run.attempt, refused)

    # ---- taking work -----------------------------------------------------------------------

    def claim(self) -> None:
        if self.conn is None or self.state not in ("up", "draining") or self.agent.stopping \
                or self.info.login:
            return
        ledger = self.agent.ledger
        db = self.agent.db
        free = [len(ledger.free_cpus), len(ledger.free_gpus), ledger.free_memory]
        for job in db.in_states("pending"):  # local work not yet allocated
            need = demand({"cpus_per_task": job.cpus_per_task, "ntasks": job.ntasks,
                           "gpus_req": job.gpus_req, "memory_mb": job.memory_mb})
            free = [f - n for f, n in zip(free, need, strict=True)]
        if min(free) < 0 or free[0] == 0:
            return
        rows = cluster_db.claim(self.conn, self.info, (free[0], free[1], free[2]))
        if rows is None:
            log.warning("node %s is not up in the cluster: rejoining", self.info.name)
            self.disconnect()
            self.join()
            return
        # The claims are the cluster's now; recorded here in one local transaction. A crash
        # before it commits leaves claims with no local job: reconcile queues them again.
        taken: list[tuple[dict[str, Any], int]] = []
        bad: list[tuple[dict[str, Any], str]] = []
        db.begin()
        try:
            for row in rows:
                why = cluster_local.invalid(row)
                if why is not None:
                    bad.append((row, why))
                    continue
                taken.append((row, cluster_local.record(db.conn, row, int(row["attempt"]))))
            db.commit()
        except BaseException:
            db.rollback()
            raise
        for row, local in taken:
            log.info("claimed cluster job %d attempt %d as local job %d", row["id"],
                     row["attempt"], local)
        for row, why in bad:  # the database let it through; this node cannot run it
            log.warning("cluster job %d attempt %d cannot run: %s", row["id"], row["attempt"],
                        why)
            cluster_db.report(self.conn, int(row["id"]), int(row["attempt"]), {
                "state": "failed", "reason": f"cannot run: {why}", "exit_code": None,
                "signal": None, "ended_at": rfc3339_now()})
        if taken:
            self.agent.schedule_due = True
