"""The agent's event loop (I/O): it performs the lifecycle's effects and feeds it events.

Theory of operation. One thread, one ``zmq.Poller`` over: the door (``shared/door.py``: every
local user's CLI, on a plain AF_UNIX socket), one DEALER per supervisor (ZeroMQ, in the run
directory's ctl/, which only this uid can enter), one pidfd per supervisor, and a signal wakeup
socket; plus a timer heap. The
database is the only durable state and is written before anyone is told anything.

Group commit. Each turn of the loop (one poll's events, the timers, the scheduler) commits its
writes one by one without an fsync; whatever they lead to outside the agent (replies, spawns,
requests to supervisors, kills) is held (``hold``); at the end of the turn the held actions go
to the sync thread as one batch (``flush``, agent/syncer.py), and come back, in order, once one
fsync has made the turn's commits durable (``synced``). So submits and transitions that arrive
together cost one fsync, none is acknowledged before it is durable, and the loop never waits
for the disk.

What happens to a (job, attempt) is decided by ``lifecycle.py`` alone (a pure transition
table); this module turns replies, timeouts, pidfds and what the run directory says into its
events (``feed``) and performs the effects it asks for (``perform``): spawn, hello, claim, wait,
terminate, ack, kill, record, release, requeue. The steps (numbered as in docs/architecture.md):
  pending -> [allocate, record ``starting`` + attempt + allocation] -> spawn -> hello -> claim
  -> [record ``running``] -> wait (long poll, re-issued) -> [record the result, free the
  allocation, answer waiters] -> ack -> the supervisor removes its run directory and exits.

When a supervisor's pidfd fires the link is drained first (its last reply and its exit can land
in one poll), then the run directory decides (``fallback.py``) and the verdict is fed as
``Gone``. A database write that fails for want of space leaves the machine as it was; the same
event is fed again ``RETRY_FULL`` seconds later, so results are recorded once space returns.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import shutil
import signal
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

import tether
import tether.shared.records
from tether.agent import api, fallback, lifecycle, statedir, users
from tether.agent.contain import BadBase, Containment
from tether.agent.db import ACTIVE, Job, Store, StoreFull
from tether.agent.ledger import Allocation, Conflict, Ledger, Request
from tether.agent.link import Link
from tether.agent.offload import Offload
from tether.agent.scheduler import Scheduler
from tether.agent.spawn import Spawner, SpawnError
from tether.agent.syncer import Syncer
from tether.shared import protocol
from tether.shared.door import Conn, Door, answer
from tether.shared.errors import RemoteError, TetherError
from tether.shared.faults import agent_fault
from tether.shared.parking import Lot
from tether.shared.paths import Layout, RunDir
from tether.shared.procid import ProcId, proc_stat
from tether.shared.timers import Timers, rfc3339_now

if TYPE_CHECKING:
    from tether.agent.cluster import ClusterConfig, ClusterNode

log = logging.getLogger("tether.agent")

HELLO_TIMEOUT = 2.0
CLAIM_TIMEOUT = 10.0
WAIT_HOLD = 60.0
RETRY_UNRESPONSIVE = 5.0
#: a supervisor that answered ``upgrading`` closes its old connections within its linger (1 s)
UPGRADE_PAUSE = 1.5
#: after a database write failed for want of space, the event is fed again this much later
RETRY_FULL = 1.0
@dataclass
class AgentConfig:
    state_dir: str
    cpu_ids: list[int]
    gpus: int
    memory_mb: int
    node: str
    cancel_grace: float = 10.0
    #: time limits (seconds): given to a job submitted without one; the most a job may ask for
    default_time: float | None = None
    max_time: float | None = None
    claim_timeout: float = 120.0
    linger: float = 3600.0
    faults: frozenset[str] = field(default_factory=frozenset)
    cluster: ClusterConfig | None = None
    #: auto, v2, v1 or none (shared/cgroup.py)
    cgroup: str = "auto"
    cgroup_base: str | None = None  #: None: contain.default_base(state_dir)
    default_memory_mb: int = 0


class AgentError(Exception):
    pass


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.layout = Layout(cfg.state_dir)
        self.ledger = Ledger(cfg.cpu_ids, cfg.gpus, cfg.memory_mb,
                             allowed=allowed_cpus())
        self.timers = Timers()
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.ctx.set(zmq.MAX_SOCKETS, 65536)
        self.poller = zmq.Poller()
        self.links: dict[int, Link] = {}
        self.by_sock: dict[zmq.Socket[Any], Link] = {}
        self.by_pidfd: dict[int, Link] = {}
        #: parked ``wait`` requests, by job id
        self.waiters: Lot[int, None] = Lot(self.timers)
        self.door: Door | None = None
        #: slow calls (user lookups, checks run as the user) off the loop
        self.offload = Offload()
        #: group commit: fsyncs the database for each turn's held actions, off the loop
        self.syncer = Syncer(lambda: self.db.fsync_wal(), self.before_sync)
        self.sync_failed = False
        #: job ids handed to submissions still being checked (recorded once they pass)
        self.reserved: set[int] = set()
        self.stopping = False
        self.reattaching: set[int] = set()
        #: live supervisors found at start, to be asked (hello) once the agent serves
        self.probes: list[tuple[int, int]] = []
        #: supervisor identities learnt from a hello, written with the claim's "running"
        self.idents: dict[int, dict[str, Any]] = {}
        #: when the agent started, while some supervisor found at start has not answered yet
        self.reattach_t0: float | None = None
        #: one machine per job whose attempt is not settled and forgotten (lifecycle.py)
        self.machines: dict[int, lifecycle.Machine] = {}
        #: events waiting for the transition in progress to complete (see ``feed``)
        self.events: deque[tuple[int, int, lifecycle.Event]] = deque()
        self.feeding = False
        #: the allocation each job holds in the ledger right now (released exactly once)
        self.allocations: dict[int, Allocation] = {}
        self.schedule_due = False
        #: the queue's pass (EASY backfill) and what it knows between passes
        self.scheduler = Scheduler(self)
        self.pidfd_owners: dict[int, Link] = {}
        self.lock_fd = -1
        self.dir_fd = -1
        #: (device, inode) of the socket this agent bound: it never unlinks another's
        self.store: Store | None = None
        self.spawner = Spawner(self.layout, self.timers,
                               watch=lambda fd: self.poller.register(fd, zmq.POLLIN),
                               unwatch=self.poller.unregister,
                               use_template=not agent_fault(cfg.faults, "no-template"),
                               hold_prep=agent_fault(cfg.faults, "hold-spawn-prep"))
        #: what this turn of the loop tells anyone or does to a process, held until the turn's
        #: commits are durable (``hold``, ``flush``): replies, spawns, requests to supervisors
        self.held: deque[Callable[[], None]] = deque()
        #: fault injection ``crash-before-sync[:N]``: SIGKILL at the Nth sync with held actions
        self.crash_at_sync = 0
        for fault in cfg.faults:
            if fault.partition(":")[0] == "crash-before-sync":
                self.crash_at_sync = int(fault.partition(":")[2] or 1)
        #: other fds in the poller and what to call when they are readable (the cluster's)
        self.extra_fds: dict[int, Callable[[], None]] = {}
        self.cluster: ClusterNode | None = None
        try:
            self.contain = Containment(cfg.cgroup, cfg.cgroup_base, cfg.default_memory_mb,
                                       cfg.state_dir)
        except BadBase as exc:
            raise AgentError(str(exc)) from None
        if cfg.cluster is not None:
            from tether.agent.cluster import ClusterNode  # psycopg only for cluster members
            self.cluster = ClusterNode(self, cfg.cluster)

    @property
    def db(self) -> Store:
        assert self.store is not None
        return self.store

    # ---- start and stop --------------------------------------------------------------------

    def run(self) -> int:
        self.layout.check()
        try:  # ours alone, or refused: see statedir.py
            # The state directory itself is locked below: unlike agent.lock, it cannot be
            # removed from under a live agent (agent.lock is still taken, for agents that know
            # only that one).
            self.dir_fd = statedir.open_state_dir(self.cfg.state_dir)
            self.lock_fd = statedir.open_lock(self.dir_fd, self.cfg.state_dir)
        except statedir.UnsafeStateDir as exc:
            if self.dir_fd >= 0:
                os.close(self.dir_fd)
                self.dir_fd = -1
            raise AgentError(str(exc)) from None
        try:
            fcntl.flock(self.dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.dir_fd)
            os.close(self.lock_fd)
            self.dir_fd = self.lock_fd = -1
            raise AgentError(f"another agent is running on {self.cfg.state_dir}") from None
        os.ftruncate(self.lock_fd, 0)
        os.write(self.lock_fd, f"{os.getpid()}\n".encode())
        old_umask = os.umask(0o077)  # the job table holds environments: root's eyes only
        try:
            self.store = Store(self.layout.db)
        finally:
            os.umask(old_umask)
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, _wake_only)
        self.poller.register(wake_r, zmq.POLLIN)
        t0 = time.monotonic()
        self.contain.start()
        try:
            self.spawner.ensure_template()
            # Serve at once: the live supervisors' allocations are back in the ledger and the
            # dead ones are resolved from disk (all synchronous), and the hello and claim of the
            # live ones are answered concurrently, in this loop, while requests are served.
            self.reattach()
            self.flush_here()
            self.reattach_t0 = t0 if self.reattaching else None
            if self.cluster is not None:
                self.cluster.start()
            self.door = Door(self.layout.sock, self.timers, self.on_request, name="agent door",
                             log=log, on_close=self.on_door_close)
            self.poller.register(self.door.fileno(), zmq.POLLIN)
            self.poller.register(self.offload.fileno(), zmq.POLLIN)
            self.poller.register(self.syncer.fileno(), zmq.POLLIN)
            log.info("agent serving on %s after %.0f ms (node %s, %d CPUs, %d GPUs, %d MB)",
                     self.layout.sock, (time.monotonic() - t0) * 1000, self.cfg.node,
                     len(self.cfg.cpu_ids), self.cfg.gpus, self.cfg.memory_mb)
            self.schedule_due = True
            while not self.stopping:
                self.step(wake_r)
        finally:
            self.shutdown()
        return 0

    def shutdown(self) -> None:
        """Stop serving. Every supervisor and every job keeps running."""
        if self.store is not None and not self.sync_failed:
            try:  # what was acknowledged in the last turns, and is durable, still goes out
                self.flush_here()
            except Exception:
                log.exception("making the last writes durable")
        if self.cluster is not None:
            self.cluster.stop()
        self.spawner.close()
        for link in list(self.links.values()):
            link.close()
        if self.door is not None:
            self.door.close()  # unlinks the socket only if it is still the one it bound
        self.offload.close()
        self.ctx.term()
        if self.store is not None:
            self.store.close()
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
        log.info("agent stopped; supervisors and jobs left running")

    def reattach_done(self) -> None:
        if self.reattach_t0 is not None and not self.reattaching:
            log.info("reattach: every live supervisor answered %.0f ms after the start",
                     (time.monotonic() - self.reattach_t0) * 1000)
            self.reattach_t0 = None

    def step(self, wake_r: socket.socket, cap_ms: int | None = None) -> None:
        if self.probes:
            cap_ms = 0  # requests already queued first, then the reattach probes
        events = self.poller.poll(self.timers.timeout_ms(time.monotonic(), cap_ms))
        # An event handled earlier in this batch may close a pidfd and a later one reopen the
        # same number for another supervisor: resolve fds against the owners at poll time.
        self.pidfd_owners = dict(self.by_pidfd)
        for item, _ in events:
            try:
                self.dispatch_event(item, wake_r)
            except AgentError:  # the database cannot be made durable: stop (crash-only)
                raise
            except Exception:  # a bug in one job's handling must not stop the node
                log.exception("internal error while handling %r", item)
        try:
            self.timers.run_due(time.monotonic())
            if self.schedule_due and self.door is not None:
                self.schedule_due = False
                self.schedule()
        except Exception:
            log.exception("internal error in a timer or the scheduler")
        probes, self.probes = self.probes, []
        for job_id, attempt in probes:
            self.feed(job_id, attempt, lifecycle.LockHeld())
        self.reattach_done()
        self.flush()

    # ---- group commit: nothing leaves before the writes it follows are durable -------------

    def hold(self, action: Callable[[], None]) -> None:
        """Do ``action`` (a reply, a spawn, a request to a supervisor: anything someone could
        act on) now if every write so far is durable and nothing held is still waiting, else
        once that is so (``flush``, ``synced``), in order."""
        if self.held or self.db.dirty or self.syncer.in_flight:
            self.held.append(action)
        else:
            action()

    def flush(self) -> None:
        """End of a turn: the turn's held actions go to the sync thread as one batch, to come
        back (``synced``) once one fsync has made the turn's commits durable (group commit).
        The loop does not wait for it."""
        if not self.held and not self.db.dirty:
            return
        sync = self.db.dirty
        if sync:
            self.db.mark_synced()
        batch, self.held = list(self.held), deque()
        self.syncer.submit(batch, sync)

    def synced(self) -> None:
        """The sync thread made batches durable: do their actions, in order. What they do
        may write and hold again (a later batch)."""
        try:
            actions = self.syncer.service()
        except OSError as exc:  # the kernel may have dropped the pages: crash-only, tell
            # nobody anything; a restarted agent reads what the disk really holds
            self.sync_failed = True
            raise AgentError(f"cannot make the database durable: {exc}") from None
        self.run_actions(actions)

    def run_actions(self, actions: list[Callable[[], None]]) -> None:
        for action in actions:
            try:
                action()
            except Exception:  # one job's bug must not keep the others' replies
                log.exception("internal error in %r", action)

    def flush_here(self) -> None:
        """Make every write durable and do every held action, on the loop and at once (before
        serving and when stopping), until nothing is left."""
        pending = self.syncer.close() if self.syncer.in_flight else []
        self.db.sync(force=bool(pending))  # they may wait for an fsync the thread never did
        self.run_actions(pending)
        while True:
            self.db.sync()
            if not self.held:
                return
            batch, self.held = list(self.held), deque()
            self.run_actions(batch)

    def before_sync(self, held: bool) -> None:
        """On the sync thread, before each fsync: the faults ``crash-before-sync[:N]`` and
        ``hold-sync``."""
        if held and agent_fault(self.cfg.faults, "hold-sync"):
            _hold(self.layout.state_dir, "sync")
        if held and agent_fault(self.cfg.faults, "fail-sync"):
            raise OSError(errno.EIO, "injected fsync failure (fault fail-sync)")
        if self.crash_at_sync and held:
            self.crash_at_sync -= 1
            if not self.crash_at_sync:
                log.warning("fault injection: SIGKILL before the sync")
                os.kill(os.getpid(), signal.SIGKILL)

    def dispatch_event(self, item: Any, wake_r: socket.socket) -> None:
        if item is wake_r or item == wake_r.fileno():
            self.on_signals(wake_r)
        elif self.door is not None and item == self.door.fileno():
            self.door.service()
        elif item == self.offload.fileno():
            self.offload.service()
        elif item == self.syncer.fileno():
            self.synced()
        elif isinstance(item, int) and self.spawner.owns(item):
            self.spawner.readable(item)
        elif isinstance(item, int) and item in self.extra_fds:
            self.extra_fds[item]()
        elif isinstance(item, int):
            pid_link = self.pidfd_owners.get(item)
            if pid_link is not None and not pid_link.closed and pid_link.pidfd == item:
                self.on_supervisor_exit(pid_link)
        else:
            sock_link = self.by_sock.get(item)
            if sock_link is not None:
                sock_link.readable()

    def on_signals(self, wake_r: socket.socket) -> None:
        try:
            data = wake_r.recv(4096)
        except BlockingIOError:
            return
        for sig in set(data):
            log.info("received %s: stopping (jobs keep running)", signal.Signals(sig).name)
            self.stopping = True

    # ---- serving the CLI -------------------------------------------------------------------

    def on_request(self, conn: Conn, req: protocol.Request) -> None:
        answer(lambda: api.dispatch(self, conn, req), req, conn,
               lambda r: self.reply(conn, r), log, api.PENDING, self.door)

    def reserve_id(self, count: int = 1) -> int:
        """The first of ``count`` consecutive ids the next recorded jobs get, held until
        ``release_id``. A refused submission gives its ids back when no later one was handed
        out, so ids stay dense."""
        job_id = max(self.db.last_id(), max(self.reserved, default=0)) + 1
        self.reserved.update(range(job_id, job_id + count))
        return job_id

    def release_id(self, job_id: int, count: int = 1) -> None:
        self.reserved.difference_update(range(job_id, job_id + count))

    def on_door_close(self, conn: Conn) -> None:
        self.waiters.drop_peer(conn.key)

    def reply(self, conn: Conn, reply: protocol.Reply) -> None:
        """Answer a client: only once what the answer tells is durable (``hold``)."""
        def send() -> None:
            if self.door is not None:
                self.door.send(conn, reply)
        self.hold(send)

    def add_waiter(self, job_id: int, conn: Conn, rid: protocol.RequestId,
                   hold: float) -> None:
        self.waiters.park(job_id, conn, rid, hold, None,
                          lambda p: self.reply(p.peer, protocol.ok(p.rid, {"done": False})))

    def job_ended(self, job: Job) -> None:
        if self.cluster is not None:
            self.hold(functools.partial(self.cluster.job_ended, job))
        for p in self.waiters.take(job.id):
            self.reply(p.peer, protocol.ok(p.rid, {"done": True, "job": self.public(job)}))
        if job.array_id is not None and self.waiters.parked(-job.array_id):
            # ``wait`` of the whole array (parked under minus its id): once every element ended
            elements = self.db.array_elements(job.array_id)
            if all(e.final for e in elements):
                outcome = self.public(api.array_outcome(elements))
                for p in self.waiters.take(-job.array_id):
                    self.reply(p.peer, protocol.ok(p.rid, {"done": True, "job": outcome}))

    # ---- scheduling ------------------------------------------------------------------------

    def schedule(self) -> None:
        """One pass of the scheduler (``scheduler.py``)."""
        self.scheduler.run()

    def start(self, job: Job) -> bool:
        """Allocate, record and spawn one job the plan starts; False if it does not fit."""
        alloc = self.ledger.allocate(Request(job.cpus_per_task * job.ntasks, job.gpus_req,
                                             job.memory_mb))
        if alloc is None:
            return False
        attempt = job.attempt + 1
        try:
            job = self.db.update(job.id, state="starting", attempt=attempt,
                                 cpus=list(alloc.cpus), gpus=list(alloc.gpus), pids=[],
                                 supervisor_pid=None, supervisor_ticks=None,
                                 supervisor_boot=None, supervisor_session=None)
        except BaseException:
            self.ledger.release(alloc)  # nothing was recorded: nothing is held
            raise
        self.allocations[job.id] = alloc
        self.scheduler.started(job)
        machine, effects = lifecycle.start(job.id, attempt, cancel=job.cancel_requested)
        self.machines[job.id] = machine
        self.perform(machine, effects)
        return True

    def public(self, job: Job) -> dict[str, Any]:
        """The job object, with a pending job's reason (Slurm's words)."""
        return self.scheduler.public(job)

    def identity(self, job: Job, umask: int) -> dict[str, Any]:
        """Who the tasks run as: the job's user, looked up again at launch (groups may change).
        On the spawner's worker thread (``launch``): the user database may be LDAP, and slow."""
        if agent_fault(self.cfg.faults, "hold-lookup"):
            _hold(self.layout.state_dir, "lookup")
        user: users.User | None
        try:
            user = users.lookup(job.user) if job.user else users.current()
        except TetherError:
            user = None
        if user is None or (job.uid is not None and user.uid != job.uid):
            raise SpawnError(f"user {job.user!r} (uid {job.uid}) no longer exists as submitted")
        gid = user.gid if job.gid is None else job.gid  # the primary gid it submitted with
        groups = sorted(set(os.getgrouplist(user.name, gid)))
        return {"uid": user.uid, "gid": gid, "groups": groups, "user": user.name,
                "home": user.home, "umask": umask}

    def launch(self, job: Job) -> None:
        """Effect ``Spawn`` (L2, L3): feeds ``Spawned`` (once the supervisor is ready) or
        ``SpawnFailed``; nothing here waits, neither for the user database nor for the file
        system (the job's user is looked up, ``identity``, and its run directory made on the
        spawner's worker thread, in one go) nor for the supervisor."""
        rd = self.layout.run_dir(job.id, job.attempt)
        base = self.spec_of(job)
        umask = self.db.umask_of(job.id)

        def spec() -> dict[str, Any]:  # on the spawner's worker thread
            return {**base, **self.identity(job, umask)}

        def wanted() -> bool:  # on the loop, before the supervisor is started
            m = self.machines.get(job.id)
            # settled meanwhile (cannot happen before a spawn; never spawn for it)
            return m is not None and m.attempt == job.attempt and \
                m.state is lifecycle.State.STARTING

        def failed(exc: BaseException) -> None:
            if not isinstance(exc, (SpawnError, OSError)):
                exc = SpawnError(f"looking up its user: {exc}")
            self.spawn_failed(job.id, job.attempt, exc)
        try:
            self.spawner.spawn(
                rd, spec, wanted=wanted,
                on_pid=lambda pid: log.info("job %d attempt %d: supervisor spawned (pid %d)",
                                            job.id, job.attempt, pid),
                # only once it is bound: hello and claim reach it at once (spawn.py)
                on_ready=lambda: self.feed(job.id, job.attempt, lifecycle.Spawned(pid=0)),
                on_gone=lambda why: self.spawn_gone(job.id, job.attempt, why),
                on_failed=failed)
        except (SpawnError, OSError) as exc:
            self.spawn_failed(job.id, job.attempt, exc)

    def spec_of(self, job: Job) -> dict[str, Any]:
        """The supervisor's spec (spec.json) but for who the tasks run as (``identity``)."""
        per = job.cpus_per_task
        spec = {
            "schema": tether.shared.records.SCHEMA, "job": job.id, "attempt": job.attempt,
            "name": job.name, "command": job.command, "ntasks": job.ntasks,
            "cpus": job.cpus, "gpus": job.gpus, "memory_mb": job.memory_mb,
            "affinity": [sorted({self.ledger.physical(c) for c in job.cpus[r * per:(r + 1) * per]})
                         for r in range(job.ntasks)],
            "env": job.env, "workdir": job.workdir, "output": job.output, "error": job.error,
            "claim_timeout": self.cfg.claim_timeout, "linger": self.cfg.linger,
            "kill_grace": self.cfg.cancel_grace, "agent_uid": os.getuid(), "pmi": job.pmi,
            # computed, no I/O: safe on the spawner's worker thread
            "cgroup": self.contain.plan(job.id, job.attempt, job.memory_mb),
        }
        if job.time_limit is not None:
            spec["time_limit"] = job.time_limit  # the supervisor enforces it (survives us)
        if job.array_id is not None:
            spec["array"] = {"id": job.array_id, "index": job.array_index}
        return spec

    def spawn_failed(self, job_id: int, attempt: int, exc: BaseException) -> None:
        """No supervisor could be started for the attempt (unless its lock says otherwise)."""
        log.error("job %d: %s", job_id, exc)
        rd = self.layout.run_dir(job_id, attempt)
        if os.path.isdir(rd.path) and not fallback.lock_is_free(rd):
            self.feed(job_id, attempt, lifecycle.Spawned(pid=0))  # it did start
        else:
            self.feed(job_id, attempt, lifecycle.SpawnFailed(reason=str(exc)))

    def spawn_gone(self, job_id: int, attempt: int, why: str) -> None:
        """The new supervisor ended before it was ready (its ready pipe closed unwritten)."""
        log.warning("job %d attempt %d: %s", job_id, attempt, why)
        if fallback.lock_is_free(self.layout.run_dir(job_id, attempt)):
            self.gone(job_id, attempt, note=why)
        else:  # someone holds its lock: it lives after all; ask it
            self.feed(job_id, attempt, lifecycle.Spawned(pid=0))

    # ---- the lifecycle: feed events, perform effects ---------------------------------------

    def feed(self, job_id: int, attempt: int, event: lifecycle.Event) -> None:
        """Hand an event to the job's machine. Events that effects raise while this runs are
        queued and handled in order after it, so each transition completes before the next."""
        self.events.append((job_id, attempt, event))
        if self.feeding:
            return
        self.feeding = True
        try:
            while self.events:
                j, a, ev = self.events.popleft()
                try:
                    self.apply(j, a, ev)
                except Exception:  # a bug in one job's handling must not stop the node
                    log.exception("job %d: internal error while handling %r", j, ev)
        finally:
            self.feeding = False

    def apply(self, job_id: int, attempt: int, event: lifecycle.Event) -> None:
        machine = self.machines.get(job_id)
        if machine is None or machine.attempt != attempt:
            return  # a late event for an attempt that is settled and forgotten
        new, effects = lifecycle.step(machine, event)
        if new is machine and not effects:
            return
        log.debug("job %d: %r + %r -> %r: %r", job_id, machine, event, new, effects)
        if agent_fault(self.cfg.faults, "skip-ack") and isinstance(event, lifecycle.ExitRecord):
            log.warning("job %d: fault injection: not acknowledging", job_id)
            effects = [e for e in effects if not isinstance(e, lifecycle.Ack)]
        self.machines[job_id] = new
        try:
            self.perform(new, effects)
        except StoreFull as exc:
            # Durable effects come first, so nothing after the failed write was done: keep the
            # old machine and feed the same event again once there may be space.
            if self.machines.get(job_id) is new:
                self.machines[job_id] = machine
            log.error("job %d: %s; trying again in %gs", job_id, exc.message, RETRY_FULL)
            self.timers.at(time.monotonic() + RETRY_FULL,
                           lambda: self.feed(job_id, attempt, event))
            return
        if new.state not in (lifecycle.State.ADOPTING, lifecycle.State.CONNECTING,
                             lifecycle.State.CLAIMING):
            self.reattaching.discard(job_id)
        if new.final and self.machines.get(job_id) is new:
            del self.machines[job_id]
            self.idents.pop(job_id, None)
            link = self.links.get(job_id)
            if link is not None:
                self.drop_link(link)

    def perform(self, m: lifecycle.Machine, effects: list[lifecycle.Effect]) -> None:
        """Durable effects (writes) and the ledger's now; every other one is held until the
        writes are durable (``hold``: the turn's single fsync), in the machine's order."""
        ended = False
        for eff in effects:
            if isinstance(eff, lifecycle.Finalize):
                self.finalize(m.job, eff)
                ended = True
            elif isinstance(eff, lifecycle.Release):
                self.release(m.job)
            elif isinstance(eff, lifecycle.Requeue):
                self.requeue(m, eff.reason)
            elif isinstance(eff, lifecycle.RecordRunning):
                who = self.idents.get(m.job, {})
                job = self.db.update(m.job, state="running", pids=list(eff.pids),
                                     started_at=eff.started_at or rfc3339_now(), **who)
                self.idents.pop(m.job, None)  # only once written: a full disk retries it
                self.scheduler.running(job)
                log.info("job %d attempt %d running: pids %s", m.job, m.attempt, job.pids)
                if self.cluster is not None:
                    self.hold(functools.partial(self.cluster.job_running, job))
            elif isinstance(eff, lifecycle.RecordPid):
                if eff.pid > 0:
                    self.db.update(m.job, supervisor_pid=eff.pid)
            elif isinstance(eff, lifecycle.Retry):
                self.timers.at(time.monotonic() + RETRY_UNRESPONSIVE,
                               lambda: self.feed(m.job, m.attempt, lifecycle.Deadline()))
            else:
                self.hold(self.outward(m, eff))
        if ended:
            self.job_ended(self.db.get_required(m.job))
            self.schedule_due = True

    def outward(self, m: lifecycle.Machine, eff: lifecycle.Effect) -> Callable[[], None]:
        """The effect ``eff`` as an action to be done once the writes before it are durable."""
        def current() -> bool:  # the attempt was not settled and forgotten meanwhile
            now = self.machines.get(m.job)
            return now is not None and now.attempt == m.attempt

        def act() -> None:
            if isinstance(eff, lifecycle.Spawn):
                if current():
                    self.launch(self.db.get_required(m.job))
            elif isinstance(eff, lifecycle.Connect):
                if current():
                    self.connect(m, fresh=eff.fresh)
            elif isinstance(eff, lifecycle.Claim):
                link = self.links.get(m.job)
                if current() and link is not None:
                    self.claim(link)
            elif isinstance(eff, lifecycle.Wait):
                link = self.links.get(m.job)
                if current() and link is not None:
                    self.wait(link)
            elif isinstance(eff, lifecycle.Terminate):
                link = self.links.get(m.job)
                if current() and link is not None:
                    self.terminate(link)
            elif isinstance(eff, lifecycle.Ack):
                if current():
                    self.ack(m)
            elif isinstance(eff, lifecycle.Disconnect):
                link = self.links.get(m.job)
                if link is not None and link.attempt == m.attempt:
                    self.drop_link(link)
            elif isinstance(eff, lifecycle.Kill):
                self.contain.clean(m.job, m.attempt)
                fallback.kill_leftovers(self.layout.run_dir(m.job, m.attempt),
                                        self.db.get(m.job))
            elif isinstance(eff, lifecycle.RemoveRunDir):
                shutil.rmtree(self.layout.run_dir(m.job, m.attempt).path, ignore_errors=True)
            else:  # pragma: no cover - the effect union is closed
                raise AssertionError(f"unknown effect {eff!r}")
        return act

    # ---- following a supervisor ------------------------------------------------------------

    def open_link(self, job: int, attempt: int, path: str) -> Link:
        link = Link(self.ctx, self.timers, job, attempt, path)
        self.links[job] = link
        self.by_sock[link.sock] = link
        self.poller.register(link.sock, zmq.POLLIN)

        def reopened(old: zmq.Socket[Any], new: zmq.Socket[Any]) -> None:
            self.by_sock.pop(old, None)
            self.poller.unregister(old)
            self.by_sock[new] = link
            self.poller.register(new, zmq.POLLIN)
        link.on_reopen = reopened
        return link

    def connect(self, m: lifecycle.Machine, *, fresh: bool) -> Link:
        """Effect ``Connect``: a link to the attempt's supervisor (kept if open), then hello."""
        rd = self.layout.run_dir(m.job, m.attempt)
        link = self.links.get(m.job)
        if link is None or link.closed or link.attempt != m.attempt:
            if link is not None:
                self.drop_link(link)
            link = self.open_link(m.job, m.attempt, rd.agent_sock())
        self.hello(link, rd, timeout=CLAIM_TIMEOUT if fresh else HELLO_TIMEOUT, fresh=fresh)
        return link

    def drop_link(self, link: Link) -> None:
        if self.links.get(link.job) is link:
            del self.links[link.job]
        self.by_sock.pop(link.sock, None)
        with contextlib.suppress(KeyError):
            self.poller.unregister(link.sock)
        if link.pidfd is not None:
            self.by_pidfd.pop(link.pidfd, None)
            with contextlib.suppress(KeyError):
                self.poller.unregister(link.pidfd)
        link.close()

    def live(self, link: Link) -> bool:
        """True while ``link`` still speaks for its job's current attempt."""
        m = self.machines.get(link.job)
        return self.links.get(link.job) is link and m is not None and m.attempt == link.attempt

    def hello(self, link: Link, rd: RunDir, timeout: float, fresh: bool = False) -> None:
        def ok(res: Any) -> None:
            if not self.live(link):
                return
            why = fallback.check_identity(rd, res, link.peer_pid)
            if why is None and link.peer_uid not in (-1, 0, os.getuid()):
                why = f"it runs as uid {link.peer_uid}, not as the agent or root"
            if why is None and res.get("protocol") not in protocol.SUPPORTED_VERSIONS:
                why = (f"it answered as tether {res.get('version')!r} in protocol "
                       f"{res.get('protocol')!r}; this agent is {tether.__version__} and speaks "
                       f"{sorted(protocol.SUPPORTED_VERSIONS)}")
            if why is not None:
                log.error("job %d: refusing the process serving %s: %s", link.job, link.path,
                          why)
                self.drop_link(link)
                self.gone(link.job, link.attempt,
                          note=f"its socket was served by an impostor ({why})")
                return
            link.protocol, link.release = res["protocol"], str(res.get("version", "?"))
            if fresh and link.release != tether.__version__:
                # The installed tether changed under this agent: its new supervisors are of
                # the new release. Driven in the protocol they share; the agent should follow.
                log.warning("job %d: its new supervisor is tether %s, this agent %s: restart "
                            "the agent to finish the upgrade", link.job, link.release,
                            tether.__version__)
            ident = ProcId(res["boot_id"], res["pid"], res["start_ticks"])
            if not link.watch(ident):
                self.drop_link(link)
                self.gone(link.job, link.attempt)
                return
            assert link.pidfd is not None
            self.by_pidfd[link.pidfd] = link
            self.poller.register(link.pidfd, zmq.POLLIN)
            job = self.db.get_required(link.job)
            st = proc_stat(ident.pid)
            session = st.session if st is not None else None
            facts = {"supervisor_pid": ident.pid, "supervisor_ticks": ident.start_ticks,
                     "supervisor_boot": ident.boot_id, "supervisor_session": session}
            phase = res["phase"]
            m = self.machines[link.job]
            if phase == "ready" and not m.cancel:
                # A claim follows: its "running" write records the identity too (one commit,
                # one fsync, fewer on every launch). Before that write, the manifest leads to
                # the step; after it, the database does too (fallback.kill_leftovers).
                self.idents[link.job] = facts
            elif (job.supervisor_pid, job.supervisor_ticks, job.supervisor_boot,
                    job.supervisor_session) != tuple(facts.values()):
                try:
                    self.db.update(job.id, **facts)
                except StoreFull as exc:
                    self.feed(link.job, link.attempt, lifecycle.LinkError(message=exc.message))
                    return
            if phase == "ready" and not m.cancel and agent_fault(self.cfg.faults,
                                                                 "stall-before-claim"):
                log.warning("job %d: fault injection: not claiming", link.job)
                return
            self.feed(link.job, link.attempt, lifecycle.HelloAnswered(phase=str(phase)))

        link.protocol = None  # hello goes out in version 1, which every release speaks
        link.request("hello", {"versions": sorted(protocol.SUPPORTED_VERSIONS)}, timeout, ok,
                     lambda exc: self.trouble(link, exc))

    def claim(self, link: Link) -> None:
        def ok(res: Any) -> None:
            if self.live(link):
                pids = tuple(t["pid"] for t in res["tasks"] if t["pid"])
                self.feed(link.job, link.attempt,
                          lifecycle.Claimed(pids=pids, started_at=res.get("started_at")))
        link.request("claim", link.target, CLAIM_TIMEOUT, ok,
                     lambda exc: self.trouble(link, exc))

    def wait(self, link: Link) -> None:
        def ok(res: Any) -> None:
            if not self.live(link):
                return
            if res.get("upgrading"):
                # It is re-executing (tether upgrade-supervisors): a request sent into the
                # closing connection would be lost, so ask again once the new image serves.
                def again() -> None:
                    if self.live(link):
                        self.wait(link)
                self.timers.at(time.monotonic() + UPGRADE_PAUSE, again)
                return
            if not res.get("done"):
                self.feed(link.job, link.attempt, lifecycle.WaitTimedOut())
                return
            verdict = fallback.verdict_of(res.get("record"), f"job {link.job}'s exit record")
            self.feed(link.job, link.attempt, lifecycle.ExitRecord(verdict=verdict))

        args = dict(link.target, hold=WAIT_HOLD)
        link.request("wait", args, WAIT_HOLD + 10.0, ok, lambda exc: self.trouble(link, exc))

    def ack(self, m: lifecycle.Machine) -> None:
        """Effect ``Ack`` (C3): once the outcome is recorded, let the supervisor clean up."""
        rd = self.layout.run_dir(m.job, m.attempt)
        if not os.path.isdir(rd.path) or fallback.lock_is_free(rd):
            self.feed(m.job, m.attempt, lifecycle.Gone(
                verdict=lifecycle.NeverRan(reason="its supervisor is gone")))
            return
        link = self.links.get(m.job)
        if link is None or link.closed:
            link = self.open_link(m.job, m.attempt, rd.agent_sock())

        def done(_: Any) -> None:
            if self.live(link):
                self.feed(link.job, link.attempt, lifecycle.Acked())

        def failed(exc: TetherError) -> None:
            if not self.live(link):
                return
            refused = isinstance(exc, RemoteError)
            if refused:
                log.warning("job %d: its supervisor refused the ack: %s", m.job, exc.message)
            else:
                log.warning("job %d: acknowledging its finished supervisor failed (%s); "
                            "trying again in %gs", m.job, exc.message, RETRY_UNRESPONSIVE)
            self.feed(link.job, link.attempt,
                      lifecycle.AckFailed(refused=refused, message=exc.message))
        link.request("ack", link.target, HELLO_TIMEOUT, done, failed)

    def terminate(self, link: Link, job: Job | None = None) -> None:
        def ok(res: Any) -> None:
            if self.live(link):
                self.feed(link.job, link.attempt,
                          lifecycle.Terminated(phase=str(res.get("phase"))))

        def err(exc: TetherError) -> None:
            log.warning("job %d: terminate failed: %s", link.job, exc.message)
        args = dict(link.target, grace=self.cfg.cancel_grace, cancel=True)
        link.request("terminate", args, HELLO_TIMEOUT, ok, err)

    def cancel(self, job: Job) -> None:
        """A cancel was recorded for an active job: tell its machine."""
        self.feed(job.id, job.attempt, lifecycle.CancelRequested())

    def trouble(self, link: Link, exc: TetherError) -> None:
        """A request failed: a dead supervisor goes to the fallback, a hung one is retried."""
        if not self.live(link):
            return
        if isinstance(exc, RemoteError):
            log.error("job %d: supervisor refused: %s", link.job, exc.message)
        rd = self.layout.run_dir(link.job, link.attempt)
        if fallback.lock_is_free(rd):
            self.gone(link.job, link.attempt)
            return
        log.warning("job %d: %s; the supervisor holds its lock, so it is alive: keeping "
                    "its allocation and asking again in %gs", link.job, exc.message,
                    RETRY_UNRESPONSIVE)
        self.feed(link.job, link.attempt, lifecycle.LinkError(message=exc.message))

    def on_supervisor_exit(self, link: Link) -> None:
        if link.ident is not None and link.ident.alive():
            return  # not its exit (defensive: pidfds only become readable when it ends)
        link.readable()  # its last reply and its exit may arrive in the same poll
        if self.live(link):
            self.gone(link.job, link.attempt)
        else:
            self.drop_link(link)

    def gone(self, job_id: int, attempt: int, note: str | None = None) -> None:
        """The supervisor may be gone: what is on disk decides (see fallback.py)."""
        rd = self.layout.run_dir(job_id, attempt)
        if not fallback.lock_is_free(rd):
            # Someone still holds the run dir's lock: the supervisor is alive, whatever answered
            # (or failed to) on its socket. Never resolve a live step from its files.
            log.error("job %d: its supervisor still holds %s%s; keeping the job and asking "
                      "again in %gs", job_id, rd.lock, f" ({note})" if note else "",
                      RETRY_UNRESPONSIVE)
            self.feed(job_id, attempt, lifecycle.LinkError(message=note or "lock held"))
            return
        job = self.db.get_required(job_id)
        verdict: lifecycle.Verdict
        try:
            verdict = fallback.resolve(rd, job)
        except Exception as exc:  # crash-only: whatever is on disk, a definite verdict
            log.exception("job %d: reading %s", job_id, rd.path)
            verdict = lifecycle.Lost(reason=f"its supervisor is gone and its run directory "
                                            f"could not be read ({type(exc).__name__})")
        if isinstance(verdict, lifecycle.NeverRan) and (
                fallback.step_processes(job) or self.contain.populated(job_id, attempt)):
            # Its files say nothing started, but processes of the step live: it did start.
            verdict = lifecycle.Lost(reason=f"{verdict.reason}, but processes of the step "
                                            "were running")
        # No supervisor holds the step any more: nothing of it may run on (a lost step's
        # processes, a setsid daemon), and its cgroup goes.
        self.contain.clean(job_id, attempt)
        if note and isinstance(verdict, lifecycle.Lost):
            verdict = lifecycle.Lost(reason=f"{verdict.reason}; {note}", kill=verdict.kill)
        self.feed(job_id, attempt, lifecycle.Gone(verdict=verdict))

    # ---- results ---------------------------------------------------------------------------

    def finalize(self, job_id: int, fin: lifecycle.Finalize) -> Job:
        """Record a final state (durable before anyone is told)."""
        job = self.db.get_required(job_id)
        fields: dict[str, Any] = {"state": fin.state, "exit_code": fin.exit_code,
                                  "signal": fin.signal, "reason": fin.reason,
                                  "ended_at": fin.ended_at or rfc3339_now(),
                                  "core_dumped": fin.core_dumped, "oom": fin.oom,
                                  "suspended_at": None}
        if job.suspended_at is not None:  # a suspended job that ended (cancelled, lost)
            fields["suspended_seconds"] = job.suspended_total(time.time())
        if fin.started_at and not job.started_at:
            fields["started_at"] = fin.started_at
        job = self.db.update(job.id, **fields)
        log.info("job %d attempt %d %s: exit_code=%s signal=%s%s", job.id, job.attempt,
                 fin.state, fin.exit_code, fin.signal, f" ({fin.reason})" if fin.reason else "")
        return job

    def cancel_pending(self, job: Job) -> Job:
        """A pending job holds nothing and has no machine: cancelled at once."""
        job = self.finalize(job.id, lifecycle.Finalize(state="cancelled",
                                                       reason="cancelled while pending"))
        self.job_ended(job)
        return job

    def release(self, job_id: int) -> None:
        self.scheduler.released(job_id)
        alloc = self.allocations.pop(job_id, None)
        if alloc is not None:
            self.ledger.release(alloc)

    def requeue(self, m: lifecycle.Machine, why: str) -> None:
        """The attempt never ran: back to the queue (the machine decided it may)."""
        self.db.update(m.job, state="pending", cpus=[], gpus=[], pids=[],
                       supervisor_pid=None, supervisor_ticks=None, supervisor_boot=None,
                       supervisor_session=None)
        log.warning("job %d attempt %d never ran (%s): back to the queue", m.job, m.attempt,
                    why)
        self.schedule_due = True

    # ---- reattach --------------------------------------------------------------------------

    def reattach(self) -> None:
        """Before serving: find every supervisor again, or find out what became of it."""
        active = self.db.in_states(*ACTIVE)
        for job in active:
            try:
                self.reattach_one(job)
            except Exception:  # one bad job must not keep the node from starting
                log.exception("job %d: reattach failed", job.id)
        wanted = {(j.id, j.attempt) for j in active}
        for rd in self.layout.run_dirs():
            if (rd.job, rd.attempt) in wanted:
                continue
            try:
                self.orphan(rd)
            except Exception:  # one odd directory must not keep the node from starting
                log.exception("%s: could not be examined", rd.path)
        for job_id, attempt in self.contain.steps_present():
            if fallback.lock_is_free(self.layout.run_dir(job_id, attempt)):
                self.contain.clean(job_id, attempt)  # its supervisor is gone: a leftover
        log.info("reattach: %d active job(s), %d to probe", len(active), len(self.reattaching))

    def reattach_one(self, job: Job) -> None:
        self.machines[job.id] = lifecycle.adopt(job.id, job.attempt,
                                                running=job.state == "running",
                                                cancel=job.cancel_requested)
        self.reattaching.add(job.id)
        try:
            self.ledger.adopt(job.allocation)
        except Conflict as exc:
            log.error("job %d: its allocation conflicts with this node's (%s); NOT adopting "
                      "it: marked lost, its supervisor (pid %s) is left alone", job.id, exc,
                      job.supervisor_pid)
            self.feed(job.id, job.attempt, lifecycle.Conflict(reason=str(exc)))
            return
        self.allocations[job.id] = job.allocation
        self.scheduler.running(job)
        self.feed(job.id, job.attempt, lifecycle.Restored())
        rd = self.layout.run_dir(job.id, job.attempt)
        if not os.path.isdir(rd.path):
            self.feed(job.id, job.attempt, lifecycle.NoRunDir(path=rd.path))
        elif fallback.lock_is_free(rd):
            self.gone(job.id, job.attempt)
        else:
            # Probed once the agent serves (``step``): the hellos wake every live supervisor
            # at once, and on a small node their answers would hold up the first request.
            self.probes.append((job.id, job.attempt))

    def orphan(self, rd: RunDir) -> None:
        """A run directory of no active attempt: an unacknowledged result, or a leftover."""
        job = self.db.get(rd.job)
        if fallback.lock_is_free(rd):
            if job is None:
                log.error("run directory %s belongs to no known job; removing it", rd.path)
            shutil.rmtree(rd.path, ignore_errors=True)
            return
        if job is not None and job.final and job.attempt == rd.attempt:
            # C2 happened, C3 (ack) did not: acknowledge now.
            machine, effects = lifecycle.orphan(rd.job, rd.attempt)
            self.machines[rd.job] = machine
            self.perform(machine, effects)
            return
        log.error("a live supervisor in %s serves no attempt this agent knows about; leaving "
                  "it alone", rd.path)


def _inode(path: str) -> tuple[int, int, int] | None:
    """Which file is at ``path``: inode numbers are reused at once, creation times are not."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def _wake_only(signum: int, frame: object) -> None:
    """Handled in the loop, through the wakeup fd."""


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 0


def _hold(state_dir: str, what: str) -> None:
    """Test fault: say ``WHAT.held`` in the state directory and wait for ``WHAT.go`` there."""
    with open(os.path.join(state_dir, f"{what}.held"), "w"):
        pass
    while not os.path.exists(os.path.join(state_dir, f"{what}.go")):
        time.sleep(0.02)
