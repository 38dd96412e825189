"""The agent's event loop (I/O): one object holding the node's state, and the loop that serves it.

Theory of operation. One thread, one poller (``poller.py``: epoll, so a turn costs what is
ready, not what is watched) over: the door (``shared/door.py``: every local user's CLI, on a
plain AF_UNIX socket), one ZeroMQ DEALER per supervisor (link.py: to its ROUTER, in the run
directory's ctl/, which only this uid can enter), one pidfd per supervisor, and a signal
wakeup socket; plus a timer heap. The database is the only durable state and is written before
anyone is told anything. Each turn of the loop (``step``) handles one poll's events, the due
timers and a scheduler pass, then hands what it held to the sync thread (group_commit.py).

The agent's work is split by what it does, each part a module of functions that take the agent
and are bound below as its methods (so every part, api.py, scheduler.py and cluster.py call them
on the agent, as before the split):
  - group_commit.py: nothing leaves before the writes it follows are durable (``hold``, ``flush``);
  - effects.py: feeds the lifecycle's events and performs its effects (``feed``, ``perform``);
    what happens to a (job, attempt) is decided by ``lifecycle.py`` alone;
  - follow.py: the link to each supervisor, its requests, and the fallback when one is gone;
  - launcher.py: allocate, record and spawn a job's attempt;
  - recovery.py: the reattach pass at start;
  - answering.py: answering clients (replies, parked ``wait`` requests, job ids held for
    submissions); api.py: the requests of the CLI; scheduler.py: the queue;
  - reload.py: the signals (stop; SIGHUP reloads the settings); metrics.py: the textfile.
This module keeps the start and stop, the poll loop and its dispatch.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from tether.agent import (
    answering,
    effects,
    follow,
    group_commit,
    launcher,
    lifecycle,
    recovery,
    reload,
    statedir,
)
from tether.agent.checks import Checks
from tether.agent.config import AgentConfig, AgentError, allowed_cpus
from tether.agent.contain import BadBase, Containment
from tether.agent.db import Store
from tether.agent.job import Job
from tether.agent.ledger import Allocation, Ledger
from tether.agent.lifecycle_events import Event, LockHeld
from tether.agent.link import Link
from tether.agent.metrics import Metrics
from tether.agent.offload import Offload
from tether.agent.persons import Persons
from tether.agent.poller import Poller
from tether.agent.retention import Purge, Tally
from tether.agent.scheduler import Scheduler
from tether.agent.spawn import Spawner
from tether.agent.syncer import Syncer
from tether.agent.topology import Topology
from tether.shared.door import Door
from tether.shared.faults import agent_fault
from tether.shared.parking import Lot
from tether.shared.paths import Layout
from tether.shared.timers import Timers

if TYPE_CHECKING:
    from tether.agent import view
    from tether.agent.cluster import ClusterNode
    from tether.agent.cluster_api import ClusterRequests

log = logging.getLogger("tether.agent")

#: supervisors' messages and exits, and reattach probes, handled in one turn of the loop at
#: most (requests, signals and finished syncs are never held back): a turn stays ~20-40 ms
TURN_EVENTS = 32


if TYPE_CHECKING:
    def _seen_as_each_part_sees_it(agent: Agent) -> None:
        """For mypy only: ``Agent`` is every protocol of view.py, its nested parts included (a
        method bound from a part checks only the outer members, not what they return)."""
        _requestargs: view.RequestArgsAgent = agent
        _retention: view.RetentionAgent = agent
        _api: view.ApiAgent = agent
        _clusterapi: view.ClusterApiAgent = agent
        _answering: view.AnsweringAgent = agent
        _cluster: view.ClusterAgent = agent
        _effects: view.EffectsAgent = agent
        _follow: view.FollowAgent = agent
        _groupcommit: view.GroupCommitAgent = agent
        _launcher: view.LauncherAgent = agent
        _metrics: view.MetricsAgent = agent
        _persons: view.PersonsAgent = agent
        _recovery: view.RecoveryAgent = agent
        _reload: view.ReloadAgent = agent
        _scheduler: view.SchedulerAgent = agent


class Agent:
    def __init__(self, cfg: AgentConfig, settings: dict[str, Any] | None = None,
                 reread: Callable[[], dict[str, Any]] | None = None) -> None:
        self.cfg = cfg
        #: the settings as options name them, and how to read them again (SIGHUP: reload.py)
        self.settings = dict(settings or {})
        self.reread = reread
        #: stopping for good (--stop-for-good and a signal): the template goes too
        self.for_good = False
        self.layout = Layout(cfg.state_dir)
        self.ledger = Ledger(cfg.cpu_ids, cfg.gpus, cfg.memory_mb,
                             allowed=allowed_cpus())
        self.timers = Timers()
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.ctx.set(zmq.MAX_SOCKETS, 65536)
        #: every fd and socket the loop waits on (epoll: a turn costs O(ready), poller.py)
        self.poller = Poller()
        self.links: dict[int, Link] = {}
        #: each link's DEALER, as the poller reports it
        self.by_sock: dict[zmq.Socket[Any], Link] = {}
        self.by_pidfd: dict[int, Link] = {}
        #: parked ``wait`` requests, by job id
        self.waiters: Lot[int, None] = Lot(self.timers)
        self.door: Door | None = None
        #: slow calls (user lookups, checks run as the user) off the loop
        self.offload = Offload()
        #: submissions' checks, each on a thread of its own, bounded per user (checks.py)
        self.checks = Checks(self.offload, self.timers, cfg.submit_check_timeout)
        #: who counts as whom at the door: a login with its subordinate uids (persons.py)
        self.persons = Persons(self)
        #: each user's bytes of job records, and the purge of ended jobs (retention.py)
        self.tally = Tally()
        self.purge = Purge(self)
        #: the node's hwloc XML for MPI ranks, gathered once the agent serves
        self.topology = Topology(self.layout.topology, cfg.hwloc_xml,
                                 missing=agent_fault(cfg.faults, "no-lstopo"))
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
        #: how long the last reattach took (recovery.py), for the metrics (metrics.py)
        self.reattach_seconds: float | None = None
        self.metrics = Metrics(self)
        #: one machine per job whose attempt is not settled and forgotten (lifecycle.py)
        self.machines: dict[int, lifecycle.Machine] = {}
        #: events waiting for the transition in progress to complete (see ``feed``)
        self.events: deque[tuple[int, int, Event]] = deque()
        self.feeding = False
        #: the allocation each job holds in the ledger right now (released exactly once)
        self.allocations: dict[int, Allocation] = {}
        self.schedule_due = False
        #: the queue's pass (EASY backfill) and what it knows between passes
        self.scheduler = Scheduler(self)
        self.lock_fd = -1
        self.dir_fd = -1
        self.store: Store | None = None
        self.spawner = Spawner(self.layout, self.timers,
                               watch=lambda fd: self.poller.register(fd, zmq.POLLIN),
                               unwatch=self.poller.unregister,
                               use_template=not agent_fault(cfg.faults, "no-template"),
                               ksm=cfg.ksm, template_linger=cfg.service.template_linger,
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
        #: people's requests answered from the cluster's database (a cluster's member only)
        self.cluster_requests: ClusterRequests | None = None
        try:
            self.contain = Containment(cfg.cgroup, cfg.cgroup_base, cfg.default_memory_mb,
                                       cfg.state_dir)
        except BadBase as exc:
            raise AgentError(str(exc)) from None
        if cfg.cluster is not None:
            from tether.agent.cluster import ClusterNode  # psycopg only for cluster members
            from tether.agent.cluster_api import ClusterRequests
            self.cluster = ClusterNode(self, cfg.cluster)
            self.cluster_requests = ClusterRequests(self, cfg.cluster.dsn)

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
        statedir.make_run_root(self.dir_fd)  # the run directories spread out (statedir.py)
        old_umask = os.umask(0o077)  # the job table holds environments: root's eyes only
        try:
            self.store = Store(self.layout.db)
        finally:
            os.umask(old_umask)
        wake_r, _wake_w = reload.wakeup()  # (kept: its fd is the signals' wakeup fd)
        self.poller.register(wake_r, zmq.POLLIN)
        t0 = time.monotonic()
        self.contain.start()
        try:
            self.spawner.template.ensure()
            # Serve at once: the live supervisors' allocations are back in the ledger and the
            # dead ones are resolved from disk (all synchronous), and the hello and claim of the
            # live ones are answered concurrently, in this loop, while requests are served.
            self.reattach()
            self.flush_here()
            self.reattach_t0 = t0 if self.reattaching else None
            if self.cluster is not None:
                self.cluster.start()
            else:
                with contextlib.suppress(FileNotFoundError):  # a member no longer
                    os.unlink(self.layout.cluster_marker)
            if self.cluster_requests is not None:
                self.cluster_requests.start()
            self.door = Door(self.layout.sock, self.timers, self.on_request, name="agent door",
                             log=log, on_close=self.on_door_close,
                             persons=self.persons.person)
            self.poller.register(self.door.fileno(), zmq.POLLIN)
            self.poller.register(self.offload.fileno(), zmq.POLLIN)
            self.poller.register(self.syncer.fileno(), zmq.POLLIN)
            self.persons.start()
            self.purge.start()
            if self.cfg.hwloc_xml != "off":
                self.offload.aside(self.topology.gather, self.topology.gathered,
                                   "tether-topology")
            log.info("agent serving on %s after %.0f ms (node %s, %d CPUs, %d GPUs, %d MB)",
                     self.layout.sock, (time.monotonic() - t0) * 1000, self.cfg.node,
                     len(self.cfg.cpu_ids), self.cfg.gpus, self.cfg.memory_mb)
            self.schedule_due = True
            self.metrics.start()
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
        if self.cluster_requests is not None:
            self.cluster_requests.close()
        self.metrics.close()  # while the database is open: its last figures say "down"
        self.spawner.close()
        if self.for_good:
            self.spawner.template.stop()
        for link in list(self.links.values()):
            link.close()
        if self.door is not None:
            self.door.close()  # unlinks the socket only if it is still the one it bound
        self.persons.stop()
        self.purge.stop()
        self.offload.close()
        self.checks.close()
        self.contain.stop()
        self.poller.close()
        self.ctx.term()
        if self.store is not None:
            self.store.close()
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
        log.info("agent stopped; supervisors and jobs left running")


    def step(self, wake_r: socket.socket, cap_ms: int | None = None) -> None:
        if self.probes:
            cap_ms = 0  # requests already queued first, then the reattach probes
        urgent = {wake_r, self.offload.fileno(), self.syncer.fileno(),
                  self.door.fileno() if self.door is not None else -1}
        events = self.poller.poll(self.timers.timeout_ms(time.monotonic(), cap_ms),
                                  TURN_EVENTS, urgent.__contains__)
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
        probes, self.probes = self.probes[:TURN_EVENTS], self.probes[TURN_EVENTS:]
        for job_id, attempt in probes:
            self.feed(job_id, attempt, LockHeld())
        self.reattach_done()
        self.flush()

    # ---- the loop's events ------------------------------------------------------------------

    def dispatch_event(self, item: Any, wake_r: socket.socket) -> None:
        if isinstance(item, int) and self.poller.stale(item):
            # An event handled earlier in this batch closed this fd (a pidfd, a spawn's
            # pipe), and a later one may have reopened the number for something else.
            return
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
            pid_link = self.by_pidfd.get(item)
            if pid_link is not None and not pid_link.closed and pid_link.pidfd == item:
                self.on_supervisor_exit(pid_link)
        else:
            sock_link = self.by_sock.get(item)
            if sock_link is not None:
                sock_link.readable()

    # ---- scheduling ------------------------------------------------------------------------

    def schedule(self) -> None:
        """One pass of the scheduler (``scheduler.py``)."""
        self.scheduler.run()


    def public(self, job: Job) -> dict[str, Any]:
        """The job object, with a pending job's reason (Slurm's words)."""
        return self.scheduler.public(job)

    # ---- the parts of the agent, each in its module (see the module docstring) -------------

    on_request = answering.on_request
    reserve_id = answering.reserve_id
    release_id = answering.release_id
    on_door_close = answering.on_door_close
    reply = answering.reply
    add_waiter = answering.add_waiter
    job_ended = answering.job_ended

    hold = group_commit.hold
    flush = group_commit.flush
    synced = group_commit.synced
    run_actions = group_commit.run_actions
    flush_here = group_commit.flush_here
    before_sync = group_commit.before_sync

    feed = effects.feed
    apply = effects.apply
    perform = effects.perform
    outward = effects.outward
    finalize = effects.finalize
    cancel = effects.cancel
    cancel_pending = effects.cancel_pending
    release = effects.release
    requeue = effects.requeue

    open_link = follow.open_link
    connect = follow.connect
    drop_link = follow.drop_link
    live = follow.live
    hello = follow.hello
    claim = follow.claim
    wait = follow.wait
    ack = follow.ack
    terminate = follow.terminate
    trouble = follow.trouble
    on_supervisor_exit = follow.on_supervisor_exit
    gone = follow.gone

    start = launcher.start
    identity = launcher.identity
    launch = launcher.launch
    spec_of = launcher.spec_of
    spawn_failed = launcher.spawn_failed
    spawn_gone = launcher.spawn_gone

    reattach = recovery.reattach
    on_signals = reload.on_signals
    reattach_one = recovery.reattach_one
    orphan = recovery.orphan
    reattach_done = recovery.reattach_done

