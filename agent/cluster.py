"""A node agent as a member of a cluster (I/O): the glue between the agent's loop and PostgreSQL.

Theory of operation. The agent runs exactly as standalone: its SQLite is the record of what runs
here, its scheduler starts local pending jobs, supervisors are followed as always. This module
only (1) turns cluster claims into local pending jobs, (2) reports local results back, and
(3) keeps the node's membership: heartbeats, declaring dead nodes down, reconciling, and the
lease its steps fence themselves by (``shared/lease.py``).

The loop never waits on the database. Each *pass* (``cluster_pass.py``) runs on a worker thread
of its own with its own connection: the loop takes a snapshot of what it knows, the worker does
the pass's statements (each bounded by the connection's timeouts), and the loop applies the
outcome when the worker's wakeup fd says it is done. One pass is in flight at a time; whatever
asks for another meanwhile (the heartbeat timer, a NOTIFY on the LISTEN connection, a job that
started or ended here) gets one more right after. The LISTEN connection is opened by the worker
and handed to the loop, which only reads notifications from it.

Races and their answers:
- Claim vs crash: the local job and its link row are inserted in a local transaction after the
  cluster's claim committed. A crash in between leaves a cluster claim with no local job, which
  the next pass puts back in the queue (it never ran).
- Result vs node declared down: ``report`` checks the current attempt in the transaction that
  writes the result; a stale result is refused and dropped.
- Database unreachable: running jobs go on; results stay in the local outbox (``cluster_local``)
  and are delivered when it returns; no new work is claimed meanwhile. While it refuses
  connections (an outage everyone sees) the lease is renewed; while it does not answer at all
  the lease runs out and the steps fence themselves.
- Database back after an outage: every heartbeat in the cluster looks stale. An agent may declare
  a node down only after it has itself been connected and heartbeating for longer than the
  timeout (so every live node has had the time to beat again).
- A node that was declared down (stopped, partitioned, slow) and comes back reconciles before it
  renews its lease: every local run whose attempt is no longer current is killed and its result
  discarded; every result of a current attempt is reported.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import psycopg
import zmq

import tether
from tether.agent import acct, batch, cluster_db, cluster_local, lifecycle, lifecycle_effects
from tether.agent.cluster_pass import Outcome, Passes, Snapshot
from tether.agent.cluster_relay import RelayServer
from tether.agent.job import FINAL, Job
from tether.agent.offload import Offload
from tether.shared import cluster_db as shared_db
from tether.shared import lease, records
from tether.shared.cluster_sql import CHANNEL_ASK, CHANNEL_JOB, CHANNEL_QUEUE, demand
from tether.shared.errors import TetherError

if TYPE_CHECKING:
    from tether.agent.config import ClusterConfig
    from tether.agent.view import ClusterAgent as Agent

log = logging.getLogger("tether.agent.cluster")

#: how long the agent's stop waits for the worker to say an idle node leaves
LEAVE_WAIT = 12.0
#: jobs in a row this node could not start, after which it drains itself (a broken install
#: would otherwise take and fail the whole queue; Slurm drains such a node too)
DRAIN_AFTER = 3


class ClusterNode:
    def __init__(self, agent: Agent, cfg: ClusterConfig) -> None:
        self.agent = agent
        self.cfg = cfg
        login = cfg.login
        self.info = cluster_db.NodeInfo(
            name=agent.cfg.node, host=socket.gethostname(), state_dir=agent.cfg.state_dir,
            cpus=0 if login else len(agent.ledger.cpu_ids),
            gpus=0 if login else len(agent.ledger.gpu_ids),
            memory_mb=0 if login else agent.ledger.memory_mb, version=tether.__version__,
            session=secrets.token_hex(8), login=login)
        #: the worker thread and its side of each pass (its connection lives there)
        self.worker = Offload(maxsize=16)
        self.passes = Passes(cfg.dsn, self.info)
        #: serves other nodes' asks of this node's steps (cluster_relay.py)
        self.relay = RelayServer(cfg.dsn, agent.cfg.state_dir, agent.layout.sock)
        #: the LISTEN connection, read on the loop only
        self.listener: shared_db.Conn | None = None
        self.fd: int | None = None
        self.in_flight = False
        self.again = False
        #: the next pass joins (connects and registers)
        self.joined = False
        self.timeout = 30.0
        #: monotonic time since which this agent has been connected and beating on time
        self.healthy_since: float | None = None
        self.last_beat = 0.0
        #: ``up``, ``draining``, ``down`` (reconciling) or ``offline`` (no database)
        self.state = "offline"
        #: local jobs already told to stop (a cancel, or a stale attempt)
        self.stopping_local: set[int] = set()
        #: claimed rows this node cannot run, reported by the next pass
        self.failures: list[tuple[int, int, str]] = []
        #: local jobs whose results say this node could not start them; how many in a row
        self.unstarted: set[int] = set()
        self.unstarted_row = 0
        #: why this node must drain itself (the next pass does it), and whether it did
        self.drain_self: str | None = None
        self.drained_self = False
        self.warned = False
        #: the database's last refusal, logged once
        self.refused = ""
        #: the local table exists (results finalized by the reattach before ``start`` are
        #: delivered by the outbox flush when the node joins)
        self.ready = False

    # ---- the agent's hooks -----------------------------------------------------------------

    def start(self) -> None:
        """Before the agent serves: set the local table up; the first pass joins."""
        db = self.agent.db
        cluster_local.ensure(db.conn)
        self.ready = True
        # tells this node's CLI that job ids are the cluster's (inspect asks where one runs)
        records.atomic_write_json(self.agent.layout.cluster_marker, {
            "schema": records.SCHEMA, "node": self.info.name, "login": self.info.login},
            mode=0o644)  # every user's CLI reads it
        for run, state in cluster_local.open_runs(db.conn):
            if state == "pending":  # claimed in the very loop turn the last agent died in
                self.stop_local(run, "abandoned at an agent restart before it started; the "
                                "cluster queues it again", discard=True)
        fd = self.worker.fileno()
        self.agent.poller.register(fd, zmq.POLLIN)
        self.agent.extra_fds[fd] = self.worker.service
        self.request_pass()
        self.agent.timers.at(time.monotonic() + self.cfg.heartbeat, self.tick)

    def stop(self) -> None:
        """The agent is stopping: an idle node leaves the cluster, a busy one stays ``up``."""
        busy = bool(self.agent.db.in_states("starting", "running"))
        owed = any(state in FINAL for _, state in cluster_local.open_runs(self.agent.db.conn))
        done = threading.Event()
        left: list[bool] = []

        def leave() -> None:
            try:
                if self.joined and not busy and not owed:
                    left.append(self.passes.leave_if_idle())
            finally:
                self.passes.close()
                done.set()
        try:
            self.worker.submit(leave, lambda r, e: None, "cluster passes")
            done.wait(LEAVE_WAIT)
        except TetherError:
            pass
        if left and left[0]:
            log.info("node %s is down: its agent stopped while idle", self.info.name)
        elif self.joined:
            log.info("node %s stays up: its jobs keep running and a restart within %gs loses "
                     "nothing", self.info.name, self.timeout)
        self.close_listener()
        self.worker.close()
        self.relay.close()

    def job_ended(self, job: Job) -> None:
        """A local job reached a final state: its result is owed (the next pass delivers it)."""
        if self.ready and cluster_local.get(self.agent.db.conn, job.id) is not None:
            self.request_pass()

    def job_running(self, job: Job) -> None:
        if self.ready and cluster_local.get(self.agent.db.conn, job.id) is not None:
            self.request_pass()  # the pass reports its start

    # ---- passes ----------------------------------------------------------------------------

    def tick(self) -> None:
        """The heartbeat timer: a pass every ``heartbeat`` seconds."""
        try:
            self.request_pass()
        finally:
            self.agent.timers.at(time.monotonic() + self.cfg.heartbeat, self.tick)

    def request_pass(self) -> None:
        if self.in_flight:
            self.again = True  # one more right after this one: what asked is in its snapshot
            return
        if not self.ready or self.agent.stopping:
            return
        snap = self.snapshot()
        self.in_flight = True
        try:
            self.worker.submit(lambda: self.passes.run(snap), self.pass_done, "cluster passes")
        except TetherError:  # its queue is full: the timer asks again
            self.in_flight = False

    def snapshot(self) -> Snapshot:
        """What the loop knows, for the next pass."""
        db = self.agent.db
        now = time.monotonic()
        may_reap = (self.joined and self.healthy_since is not None
                    and now - self.healthy_since > self.timeout)
        snap = Snapshot(join=not self.joined, may_reap=may_reap,
                        failures=self.failures, drain=self.drain_self)
        self.failures = []
        for run, state in cluster_local.open_runs(db.conn):
            snap.known.add((run.cluster_job, run.attempt))
            job = db.get(run.local_job)
            if job is None:
                continue
            if state in FINAL:
                result = dict(result_of(job), usage=acct.usage_of(db, job.id))
                snap.results.append((job.id, run.cluster_job, run.attempt, result))
                if result["never_ran"]:
                    self.unstarted.add(job.id)
            elif job.state == "running":
                snap.running[(run.cluster_job, run.attempt)] = {
                    "local_job": job.id, "started_at": job.started_at, "cpus": job.cpus,
                    "gpus": job.gpus, "pids": job.pids, "supervisor_pid": job.supervisor_pid}
        snap.free = self.free()
        return snap

    def free(self) -> tuple[int, int, int] | None:
        """What this node may claim now, or None: it claims nothing (a login node, stopping)."""
        if self.info.login or self.agent.stopping:
            return None
        ledger = self.agent.ledger
        free = [len(ledger.free_cpus), len(ledger.free_gpus), ledger.free_memory]
        for job in self.agent.db.in_states("pending"):  # local work not yet allocated
            need = demand({"cpus_per_task": job.cpus_per_task, "ntasks": job.ntasks,
                           "gpus_req": job.gpus_req, "memory_mb": job.memory_mb})
            free = [f - n for f, n in zip(free, need, strict=True)]
        # a full node still claims with nothing free: its pass plans the cluster's queue all
        # the same (the pending reasons; cluster_sched.py), and takes nothing itself
        return (max(0, free[0]), max(0, free[1]), max(0, free[2]))

    def pass_done(self, out: Outcome | None, exc: BaseException | None) -> None:
        """On the loop: apply what the pass did, or take its failure."""
        self.in_flight = False
        try:
            if exc is not None:
                self.failed(exc)
            elif out is not None:
                self.apply(out)
        finally:
            if self.again:
                self.again = False
                self.request_pass()

    def failed(self, exc: BaseException) -> None:
        """A pass failed; the database's failures never stop the agent."""
        self.disconnect()
        if isinstance(exc, (psycopg.Error, shared_db.ClusterUnreachable)):
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
        elif isinstance(exc, TetherError):  # refused: not a node's login, another agent's node
            if exc.message != self.refused:  # said once, not at every heartbeat
                log.error("cluster: %s", exc.message)
                self.refused = exc.message
        else:
            log.error("cluster pass failed: %s", exc, exc_info=exc)

    def apply(self, out: Outcome) -> None:
        now = time.monotonic()
        self.timeout = out.timeout
        if out.listener is not None:
            self.close_listener()
            self.listener = out.listener
            self.fd = out.listener.fileno()
            self.agent.poller.register(self.fd, zmq.POLLIN)
            self.agent.extra_fds[self.fd] = self.readable
        if out.state == "taken":
            log.error("node %s was registered by another agent: this one leaves the cluster",
                      self.info.name)
            self.disconnect()
            return
        if out.was is not None:  # joined or rejoined
            if not self.joined and self.warned:
                log.info("cluster database reachable again")
            self.warned = False
            self.refused = ""
            self.joined = True
            self.healthy_since = now
            if out.was == "down" and self.state != "offline":
                log.warning("node %s was declared down while this agent was away: "
                            "reconciling before taking any work", self.info.name)
        elif now - self.last_beat > self.timeout or self.healthy_since is None:
            # We were stopped or starved for longer than the timeout: others may have declared
            # us down, and we cannot judge their heartbeats until we have beaten on time again.
            self.healthy_since = now
        self.last_beat = now
        for done in out.reaped:
            log.warning("%s: requeued jobs %s, failed jobs %s", done["reason"],
                        done["requeued"], done["failed"])
        self.delivered(out)
        self.reconcile(out)
        if out.state == "not_up":
            log.warning("node %s is not up in the cluster: rejoining", self.info.name)
            self.joined = False
            self.again = True
            return
        if out.state == "up" and self.drained_self:  # resumed by root: mended, we trust
            self.drained_self, self.drain_self, self.unstarted_row = False, None, 0
        self.state = out.state
        if out.sent is not None:
            self.renew(out.sent)  # after the reconcile: a stale run is stopped, not given time
        if out.was == "down":
            log.info("node %s rejoined the cluster after reconciling", self.info.name)
        elif out.was is not None:
            log.info("node %s joined the cluster%s (heartbeat %gs, timeout %gs)",
                     self.info.name, " as a login node" if self.info.login else "",
                     self.cfg.heartbeat, self.timeout)
        self.record_claims(out.claimed)
        self.relay.wake()  # asks a lost notification left waiting (cheap: one statement)

    def readable(self) -> None:
        """The LISTEN connection has notifications: a pass for them (coalesced)."""
        if self.listener is None:
            return
        try:
            got = list(self.listener.notifies(timeout=0, stop_after=256))
        except psycopg.Error as exc:
            self.failed(exc)
            return
        if any(n.channel in (CHANNEL_QUEUE, CHANNEL_JOB) for n in got):
            self.request_pass()
        if any(n.channel == CHANNEL_ASK and n.payload == self.info.name for n in got):
            self.relay.wake()
        for n in got:
            if n.channel == CHANNEL_JOB and n.payload.isdigit() \
                    and self.agent.cluster_requests is not None:
                self.agent.cluster_requests.job_changed(int(n.payload))

    def close_listener(self) -> None:
        if self.fd is not None:
            self.agent.extra_fds.pop(self.fd, None)
            try:
                self.agent.poller.unregister(self.fd)
            except KeyError:
                pass
            self.fd = None
        if self.listener is not None:
            try:
                self.listener.close()
            except psycopg.Error:
                pass
            self.listener = None

    def disconnect(self) -> None:
        """Forget the connection: the next pass joins anew (the worker closed its own)."""
        self.close_listener()
        self.joined = False
        self.state = "offline"
        self.healthy_since = None

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

    # ---- applying a pass -------------------------------------------------------------------

    def delivered(self, out: Outcome) -> None:
        """Results the database recorded or refused: marked so, after its commit (a crash
        before reports again, and the repeat is refused: the job is no longer active)."""
        db = self.agent.db
        if out.drained and not self.drained_self:
            self.drained_self = True
            log.error("node %s drained itself: %s (resume it once it is mended)",
                      self.info.name, self.drain_self)
        for local, cj, attempt, refused, state in out.reported:
            cluster_local.set_status(db.conn, local, "reported" if refused is None
                                     else "refused")
            if local in self.unstarted:
                self.unstarted.discard(local)
                self.unstarted_row += 1
                if self.unstarted_row >= DRAIN_AFTER and self.drain_self is None:
                    self.drain_self = (f"{self.unstarted_row} jobs in a row could not be "
                                       f"started here (the last: cluster job {cj})")
                    self.again = True
            else:
                self.unstarted_row = 0
            if refused is None:
                log.info("cluster job %d attempt %d: result delivered (%s)", cj, attempt, state)
            else:
                log.warning("cluster job %d attempt %d: result refused and dropped: %s", cj,
                            attempt, refused)
        for cj, _, why in out.requeued:
            log.warning("cluster job %d: %s", cj, why)

    def reconcile(self, out: Outcome) -> None:
        """Stop every local run the database no longer gives this node, and those whose cancel
        was asked (the runs recorded when the pass began: claims come after)."""
        db = self.agent.db
        for run, _ in cluster_local.open_runs(db.conn):
            row = out.current.get((run.cluster_job, run.attempt))
            job = db.get(run.local_job)
            if job is None or job.final:
                continue  # the outbox reports it (or has it refused)
            if row is None:
                self.stop_local(run, f"cluster job {run.cluster_job} attempt {run.attempt} is "
                                "no longer this node's (it was requeued or ended elsewhere)",
                                discard=True)
            elif row["cancel_requested"]:
                self.stop_local(run, "cancelled", discard=False)

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

    def record_claims(self, rows: list[dict[str, Any]]) -> None:
        """The claims are the cluster's already; recorded here in one local transaction."""
        if not rows:
            return
        db = self.agent.db
        taken: list[tuple[dict[str, Any], int]] = []
        db.begin()
        try:
            for row in rows:
                why = cluster_local.invalid(row)
                if why is not None:  # the database let it through; this node cannot run it
                    log.warning("cluster job %s attempt %s cannot run: %s", row.get("id"),
                                row.get("attempt"), why)
                    self.failures.append((int(row["id"]), int(row["attempt"]), why))
                    continue
                local = cluster_local.record(db.conn, row, int(row["attempt"]), self.info.name)
                script = cluster_local.script_of(row)
                if script is not None or row.get("slurm_env"):  # as a node's own submit keeps it
                    batch.record(db, local, 1, script, bool(row.get("slurm_env")))
                taken.append((row, local))
            db.commit()
        except BaseException:
            db.rollback()
            raise
        for row, local in taken:
            log.info("claimed cluster job %d attempt %d as local job %d", row["id"],
                     row["attempt"], local)
        if taken:
            self.agent.schedule_due = True
        if self.failures:
            self.again = True


def result_of(job: Job) -> dict[str, Any]:
    """A final local job's result, as the cluster records it."""
    return {
        "state": job.state, "exit_code": job.exit_code, "signal": job.signal,
        "reason": job.reason, "started_at": job.started_at, "ended_at": job.ended_at,
        "pids": job.pids, "supervisor_pid": job.supervisor_pid, "cpus": job.cpus,
        "gpus": job.gpus, "local_job": job.id,
        # the node's loss, not the job's failure: requeued or node_fail (lease.py)
        "fenced": job.state == "failed" and (job.reason or "").startswith(lease.FENCED),
        # this node could not start it: it never ran, and goes back to the queue
        "never_ran": never_ran(job)}


def never_ran(job: Job) -> bool:
    """Did this node fail to start the job's step at all (lifecycle.py's "never started")?"""
    return job.state == "failed" and job.started_at is None and (job.reason or "").startswith(
        lifecycle.UNSTARTED)
