"""The agent's event loop and job lifecycle (I/O).

Theory of operation. One thread, one ``zmq.Poller`` over: the door (``shared/door.py``: every
local user's CLI, on a plain AF_UNIX socket), one DEALER per supervisor (ZeroMQ, in the run
directory's ctl/, which only this uid can enter), one pidfd per supervisor, and a signal wakeup
socket; plus a timer heap. The
database is the only durable state and is written before anyone is told anything.

A job's life, as seen from here (the numbers are those of docs/architecture.md):
  pending -> [allocate, record ``starting`` + attempt + allocation] -> spawn -> hello -> claim
  -> [record ``running``] -> wait (long poll, re-issued) -> [record the result, free the
  allocation, answer waiters] -> ack -> the supervisor removes its run directory and exits.

When a supervisor's pidfd fires the link is drained first (its last reply and its exit can land
in one poll), then, if the job is still active, the run directory decides: see ``fallback.py``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

import tether.shared.records
from tether.agent import api, fallback, statedir, users
from tether.agent.db import ACTIVE, Job, Store
from tether.agent.ledger import Conflict, Ledger, Request
from tether.agent.link import Link
from tether.agent.offload import Offload
from tether.agent.spawn import SpawnError, spawn_supervisor
from tether.shared import protocol
from tether.shared.door import Conn, Door
from tether.shared.errors import RemoteError, TetherError
from tether.shared.parking import Lot
from tether.shared.paths import Layout, RunDir
from tether.shared.procid import ProcId
from tether.shared.text import clip
from tether.shared.timers import Timers, rfc3339_now

log = logging.getLogger("tether.agent")

HELLO_TIMEOUT = 2.0
CLAIM_TIMEOUT = 10.0
WAIT_HOLD = 60.0
RETRY_UNRESPONSIVE = 5.0
REATTACH_DEADLINE = 3.0
#: attempts after which a job whose supervisor never started is failed rather than requeued
MAX_ATTEMPTS = 5



@dataclass
class AgentConfig:
    state_dir: str
    cpu_ids: list[int]
    gpus: int
    memory_mb: int
    node: str
    cancel_grace: float = 10.0
    claim_timeout: float = 120.0
    linger: float = 3600.0
    faults: frozenset[str] = field(default_factory=frozenset)


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
        #: job ids handed to submissions still being checked (recorded once they pass)
        self.reserved: set[int] = set()
        self.stopping = False
        self.reattaching: set[int] = set()
        #: jobs whose allocation is in the ledger right now (released exactly once)
        self.holding: set[int] = set()
        #: every open link, including ad-hoc ones (orphan acks) that serve no active job
        self.all_links: set[Link] = set()
        self.schedule_due = False
        self.pidfd_owners: dict[int, Link] = {}
        self.lock_fd = -1
        self.store: Store | None = None

    @property
    def db(self) -> Store:
        assert self.store is not None
        return self.store

    # ---- start and stop --------------------------------------------------------------------

    def run(self) -> int:
        self.layout.check()
        try:  # ours alone, or refused: see statedir.py
            dir_fd = statedir.open_state_dir(self.cfg.state_dir)
            try:
                self.lock_fd = statedir.open_lock(dir_fd, self.cfg.state_dir)
            finally:
                os.close(dir_fd)
        except statedir.UnsafeStateDir as exc:
            raise AgentError(str(exc)) from None
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
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
        try:
            self.reattach()
            deadline = time.monotonic() + REATTACH_DEADLINE
            while self.reattaching and time.monotonic() < deadline and not self.stopping:
                self.step(wake_r, cap_ms=int((deadline - time.monotonic()) * 1000) + 1)
            if self.reattaching:
                log.warning("reattach: %d supervisor(s) still unresolved; serving anyway",
                            len(self.reattaching))
            self.door = Door(self.layout.sock, self.timers, self.on_request, name="agent door",
                             log=log, on_close=self.on_door_close)
            self.poller.register(self.door.fileno(), zmq.POLLIN)
            self.poller.register(self.offload.fileno(), zmq.POLLIN)
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
        for link in list(self.all_links):
            link.close()
        if self.door is not None:
            self.door.close()  # unlinks the socket only if it is still the one it bound
        self.offload.close()
        self.ctx.term()
        if self.store is not None:
            self.store.close()
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
        log.info("agent stopped; supervisors and jobs left running")

    def step(self, wake_r: socket.socket, cap_ms: int | None = None) -> None:
        events = self.poller.poll(self.timers.timeout_ms(time.monotonic(), cap_ms))
        # An event handled earlier in this batch may close a pidfd and a later one reopen the
        # same number for another supervisor: resolve fds against the owners at poll time.
        self.pidfd_owners = dict(self.by_pidfd)
        for item, _ in events:
            try:
                self.dispatch_event(item, wake_r)
            except Exception:  # a bug in one job's handling must not stop the node
                log.exception("internal error while handling %r", item)
        try:
            self.timers.run_due(time.monotonic())
            if self.schedule_due and self.door is not None:
                self.schedule_due = False
                self.schedule()
        except Exception:
            log.exception("internal error in a timer or the scheduler")

    def dispatch_event(self, item: Any, wake_r: socket.socket) -> None:
        if item is wake_r or item == wake_r.fileno():
            self.on_signals(wake_r)
        elif self.door is not None and item == self.door.fileno():
            self.door.service()
        elif item == self.offload.fileno():
            self.offload.service()
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
        try:
            result = api.dispatch(self, conn, req)
        except TetherError as exc:
            if exc.code == "permission_denied":
                log.warning("refused %s from %s: %s", clip(repr(req.kind), 60), conn,
                            clip(exc.message))
            self.reply(conn, protocol.error(req.id, exc))
            return
        except Exception:  # a bug must never take the agent down
            log.exception("handler for %s failed", clip(repr(req.kind), 60))
            self.reply(conn, protocol.error(req.id, TetherError("internal error")))
            return
        if result is not api.PENDING:
            self.reply(conn, protocol.ok(req.id, result))

    def reserve_id(self) -> int:
        """The id the next recorded job gets, held until ``release_id``. A refused submission
        gives its id back when no later one was handed out, so ids stay dense."""
        job_id = max(self.db.last_id(), max(self.reserved, default=0)) + 1
        self.reserved.add(job_id)
        return job_id

    def release_id(self, job_id: int) -> None:
        self.reserved.discard(job_id)

    def on_door_close(self, conn: Conn) -> None:
        self.waiters.drop_peer(conn.key)

    def reply(self, conn: Conn, reply: protocol.Reply) -> None:
        if self.door is not None:
            self.door.send(conn, reply)

    def add_waiter(self, job_id: int, conn: Conn, rid: protocol.RequestId,
                   hold: float) -> None:
        self.waiters.park(job_id, conn, rid, hold, None,
                          lambda p: self.reply(p.peer, protocol.ok(p.rid, {"done": False})))

    def job_ended(self, job: Job) -> None:
        for p in self.waiters.take(job.id):
            self.reply(p.peer, protocol.ok(p.rid, {"done": True, "job": job.public()}))

    # ---- scheduling ------------------------------------------------------------------------

    def schedule(self) -> None:
        """Start queued jobs in strict FIFO order while the head of the queue fits."""
        while True:
            job = self.db.first_pending()
            if job is None:
                return
            alloc = self.ledger.allocate(Request(job.cpus_per_task * job.ntasks, job.gpus_req,
                                                 job.memory_mb))
            if alloc is None:
                return
            self.holding.add(job.id)
            attempt = job.attempt + 1
            job = self.db.update(job.id, state="starting", attempt=attempt, cpus=list(alloc.cpus),
                                 gpus=list(alloc.gpus), pids=[], supervisor_pid=None,
                                 supervisor_ticks=None)
            self.launch(job)

    def identity(self, job: Job) -> dict[str, Any]:
        """Who the tasks run as: the job's user, looked up again at launch (groups may change)."""
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
                "home": user.home, "umask": 0o022 if job.umask is None else job.umask}

    def launch(self, job: Job) -> None:
        rd = self.layout.run_dir(job.id, job.attempt)
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
        }
        try:
            spec.update(self.identity(job))
            pid = spawn_supervisor(self.layout, rd, spec)
        except (SpawnError, OSError) as exc:
            log.error("job %d: %s", job.id, exc)
            if os.path.isdir(rd.path) and not fallback.lock_is_free(rd):
                self.connect(job, rd, fresh=True)  # it did start after all: follow it
                return
            shutil.rmtree(rd.path, ignore_errors=True)
            self.finalize(job, state="failed", exit_code=None, sig=None,
                          reason=f"could not start its supervisor: {exc}")
            return
        log.info("job %d attempt %d: supervisor spawned (pid %d)", job.id, job.attempt, pid)
        self.db.update(job.id, supervisor_pid=pid)
        self.connect(job, rd, fresh=True)

    # ---- following a supervisor ------------------------------------------------------------

    def open_link(self, job: int, attempt: int, path: str, *, track: bool) -> Link:
        link = Link(self.ctx, self.timers, job, attempt, path)
        if track:
            self.links[job] = link
        self.all_links.add(link)
        self.by_sock[link.sock] = link
        self.poller.register(link.sock, zmq.POLLIN)

        def reopened(old: zmq.Socket[Any], new: zmq.Socket[Any]) -> None:
            self.by_sock.pop(old, None)
            self.poller.unregister(old)
            self.by_sock[new] = link
            self.poller.register(new, zmq.POLLIN)
        link.on_reopen = reopened
        return link

    def connect(self, job: Job, rd: RunDir, *, fresh: bool) -> Link:
        link = self.open_link(job.id, job.attempt, rd.agent_sock(), track=True)
        self.hello(link, rd, timeout=CLAIM_TIMEOUT if fresh else HELLO_TIMEOUT)
        return link

    def drop_link(self, link: Link) -> None:
        if self.links.get(link.job) is link:
            del self.links[link.job]
        self.all_links.discard(link)
        self.by_sock.pop(link.sock, None)
        with contextlib.suppress(KeyError):
            self.poller.unregister(link.sock)
        if link.pidfd is not None:
            self.by_pidfd.pop(link.pidfd, None)
            with contextlib.suppress(KeyError):
                self.poller.unregister(link.pidfd)
        link.close()
        self.reattaching.discard(link.job)

    def current(self, link: Link) -> Job | None:
        """The job this link still speaks for, or None if the link is stale."""
        if self.links.get(link.job) is not link:
            return None
        job = self.db.get(link.job)
        if job is None or job.attempt != link.attempt:
            return None
        return job

    def hello(self, link: Link, rd: RunDir, timeout: float) -> None:
        def ok(res: Any) -> None:
            job = self.current(link)
            if job is None:
                return
            why = fallback.check_identity(rd, res, link.peer_pid)
            if why is None and link.peer_uid not in (-1, 0, os.getuid()):
                why = f"it runs as uid {link.peer_uid}, not as the agent or root"
            if why is None and res.get("protocol") not in protocol.SUPPORTED_VERSIONS:
                why = f"it answered in protocol version {res.get('protocol')!r}"
            if why is not None:
                log.error("job %d: refusing the process serving %s: %s", job.id, link.path,
                          why)
                self.drop_link(link)
                self.gone(job, note=f"its socket was served by an impostor ({why})")
                return
            ident = ProcId(res["boot_id"], res["pid"], res["start_ticks"])
            if not link.watch(ident):
                self.drop_link(link)
                self.gone(job)
                return
            assert link.pidfd is not None
            self.by_pidfd[link.pidfd] = link
            self.poller.register(link.pidfd, zmq.POLLIN)
            if job.supervisor_pid != ident.pid or job.supervisor_ticks != ident.start_ticks:
                self.db.update(job.id, supervisor_pid=ident.pid,
                               supervisor_ticks=ident.start_ticks)
            phase = res["phase"]
            if phase in ("exited", "aborted") or job.final:
                self.wait(link)
            elif job.cancel_requested and phase == "ready":
                self.terminate(link, job)
            elif phase == "ready" and "stall-before-claim" in self.cfg.faults:
                log.warning("job %d: fault injection: not claiming", job.id)
            else:
                self.claim(link)

        def err(exc: TetherError) -> None:
            self.trouble(link, rd, exc)
        link.request("hello", {"versions": sorted(protocol.SUPPORTED_VERSIONS)}, timeout, ok, err)

    def claim(self, link: Link) -> None:
        def ok(res: Any) -> None:
            job = self.current(link)
            if job is None:
                return
            self.reattaching.discard(job.id)
            pids = [t["pid"] for t in res["tasks"] if t["pid"]]
            if job.state != "running":
                job = self.db.update(job.id, state="running", pids=pids,
                                     started_at=res.get("started_at") or rfc3339_now())
                log.info("job %d attempt %d running: pids %s", job.id, job.attempt, pids)
            if job.cancel_requested:
                self.terminate(link, job)
            self.wait(link)

        def err(exc: TetherError) -> None:
            self.trouble(link, self.layout.run_dir(link.job, link.attempt), exc)
        link.request("claim", link.target, CLAIM_TIMEOUT, ok, err)

    def wait(self, link: Link) -> None:
        def ok(res: Any) -> None:
            job = self.current(link)
            if job is None:
                return
            self.reattaching.discard(job.id)
            if not res.get("done"):
                self.wait(link)
                return
            self.collect(job, res["record"])
            if "skip-ack" in self.cfg.faults:
                log.warning("job %d: fault injection: not acknowledging", job.id)
                return
            self.ack(link)

        def err(exc: TetherError) -> None:
            self.trouble(link, self.layout.run_dir(link.job, link.attempt), exc)
        args = dict(link.target, hold=WAIT_HOLD)
        link.request("wait", args, WAIT_HOLD + 10.0, ok, err)

    def ack(self, link: Link) -> None:
        def done(_: Any) -> None:
            self.drop_link(link)

        def failed(exc: TetherError) -> None:
            self.drop_link(link)
            self.ack_failed(self.layout.run_dir(link.job, link.attempt), exc)
        link.request("ack", link.target, HELLO_TIMEOUT, done, failed)

    def ack_failed(self, rd: RunDir, exc: TetherError) -> None:
        """A recorded result whose supervisor did not take the ack: ask again while it lives."""
        if isinstance(exc, RemoteError):
            log.warning("job %d: its supervisor refused the ack: %s", rd.job, exc.message)
            return
        log.warning("job %d: acknowledging its finished supervisor failed (%s); trying again "
                    "in %gs", rd.job, exc.message, RETRY_UNRESPONSIVE)

        def again() -> None:
            if not os.path.isdir(rd.path):
                return
            if fallback.lock_is_free(rd):
                shutil.rmtree(rd.path, ignore_errors=True)
            else:
                self.orphan(rd)
        self.timers.at(time.monotonic() + RETRY_UNRESPONSIVE, again)

    def terminate(self, link: Link, job: Job) -> None:
        def ok(res: Any) -> None:
            job = self.current(link)
            if job is not None and res.get("phase") == "aborted":
                self.drop_link(link)
                self.finalize(job, state="cancelled", exit_code=None, sig=None,
                              reason="cancelled before it started")
                shutil.rmtree(self.layout.run_dir(job.id, job.attempt).path, ignore_errors=True)

        def err(exc: TetherError) -> None:
            log.warning("job %d: terminate failed: %s", job.id, exc.message)
        args = dict(link.target, grace=self.cfg.cancel_grace, cancel=True)
        link.request("terminate", args, HELLO_TIMEOUT, ok, err)

    def trouble(self, link: Link, rd: RunDir, exc: TetherError) -> None:
        """A request failed: a dead supervisor goes to the fallback, a hung one is retried."""
        job = self.current(link)
        if job is None:
            self.drop_link(link)
            return
        if isinstance(exc, RemoteError):
            log.error("job %d: supervisor refused: %s", job.id, exc.message)
        if fallback.lock_is_free(rd):
            self.drop_link(link)
            self.gone(job)
            return
        log.warning("job %d: %s; the supervisor holds its lock, so it is alive: keeping "
                    "its allocation and asking again in %gs", job.id, exc.message,
                    RETRY_UNRESPONSIVE)
        self.reattaching.discard(job.id)

        def retry() -> None:
            if self.current(link) is not None:
                self.hello(link, rd, HELLO_TIMEOUT)
        self.timers.at(time.monotonic() + RETRY_UNRESPONSIVE, retry)

    def on_supervisor_exit(self, link: Link) -> None:
        if link.ident is not None and link.ident.alive():
            return  # not its exit (defensive: pidfds only become readable when it ends)
        link.readable()  # its last reply and its exit may arrive in the same poll
        job = self.current(link)
        pidfd = link.pidfd
        if pidfd is not None and self.by_pidfd.get(pidfd) is link:
            self.drop_link(link)
        rd = self.layout.run_dir(link.job, link.attempt)
        if job is not None and not job.final:
            self.gone(job)
        elif fallback.lock_is_free(rd):
            shutil.rmtree(rd.path, ignore_errors=True)

    # ---- results ---------------------------------------------------------------------------

    def collect(self, job: Job, record: dict[str, Any]) -> None:
        """Record what the supervisor reported (idempotent: a recorded result stands)."""
        if job.final:
            return
        if record.get("state") == "aborted" or not record.get("launched", True):
            self.requeue_or_cancel(job, record.get("reason") or "its supervisor gave up")
            return
        self.finalize(job, state=record["state"], exit_code=record.get("exit_code"),
                      sig=record.get("signal"), reason=record.get("reason"),
                      started_at=record.get("started_at"), ended_at=record.get("ended_at"))

    def finalize(self, job: Job, *, state: str, exit_code: int | None, sig: int | None,
                 reason: str | None, started_at: str | None = None,
                 ended_at: str | None = None) -> None:
        fields: dict[str, Any] = {"state": state, "exit_code": exit_code, "signal": sig,
                                  "reason": reason, "ended_at": ended_at or rfc3339_now()}
        if started_at and not job.started_at:
            fields["started_at"] = started_at
        job = self.db.update(job.id, **fields)
        self.release(job)
        log.info("job %d attempt %d %s: exit_code=%s signal=%s%s", job.id, job.attempt, state,
                 exit_code, sig, f" ({reason})" if reason else "")
        self.reattaching.discard(job.id)
        self.job_ended(job)
        self.schedule_due = True

    def lose(self, job: Job, reason: str) -> None:
        """No result will ever come: ``lost``, or ``cancelled`` if that was asked for."""
        if job.cancel_requested:
            self.finalize(job, state="cancelled", exit_code=None, sig=None,
                          reason=f"cancelled; {reason}")
        else:
            self.finalize(job, state="lost", exit_code=None, sig=None, reason=reason)

    def release(self, job: Job) -> None:
        if job.id in self.holding:
            self.holding.discard(job.id)
            self.ledger.release(job.allocation)

    def requeue_or_cancel(self, job: Job, why: str) -> None:
        """The attempt never ran: back to the queue, unless it was cancelled meanwhile."""
        if job.cancel_requested:
            self.finalize(job, state="cancelled", exit_code=None, sig=None,
                          reason="cancelled before it started")
            return
        if job.attempt >= MAX_ATTEMPTS:
            self.finalize(job, state="failed", exit_code=None, sig=None,
                          reason=f"never started in {job.attempt} attempts; last: {why}")
            return
        self.release(job)
        self.db.update(job.id, state="pending", cpus=[], gpus=[], pids=[],
                       supervisor_pid=None, supervisor_ticks=None)
        log.warning("job %d attempt %d never ran (%s): back to the queue", job.id, job.attempt,
                    why)
        self.reattaching.discard(job.id)
        self.schedule_due = True

    def gone(self, job: Job, note: str | None = None) -> None:
        """The supervisor is gone: what is on disk decides (see fallback.py)."""
        rd = self.layout.run_dir(job.id, job.attempt)
        if not fallback.lock_is_free(rd):
            # Someone still holds the run dir's lock: the supervisor is alive, whatever answered
            # (or failed to) on its socket. Never resolve a live step from its files.
            log.error("job %d: its supervisor still holds %s%s; keeping the job and asking "
                      "again in %gs", job.id, rd.lock, f" ({note})" if note else "",
                      RETRY_UNRESPONSIVE)
            self.timers.at(time.monotonic() + RETRY_UNRESPONSIVE, lambda: self.refollow(job.id))
            return
        verdict = fallback.resolve(rd, job)
        if verdict.kind == "never-ran" and job.state == "running":
            # The claim was confirmed, so tasks did start: requeueing would run the job twice.
            verdict = fallback.Verdict("lost", f"{verdict.reason}, but it was recorded as "
                                               "running; it is not run again")
        if verdict.kind == "result":
            assert verdict.record is not None
            self.collect(job, verdict.record)
        elif verdict.kind == "never-ran":
            self.requeue_or_cancel(job, verdict.reason)
        else:
            self.lose(job, verdict.reason + (f"; {note}" if note else ""))
        shutil.rmtree(rd.path, ignore_errors=True)

    def refollow(self, job_id: int) -> None:
        """Connect to a job's supervisor again (after trouble), unless something else has."""
        job = self.db.get(job_id)
        if job is None or job.final or job.state not in ACTIVE or job_id in self.links:
            return
        rd = self.layout.run_dir(job.id, job.attempt)
        if fallback.lock_is_free(rd):
            self.gone(job)
        else:
            self.connect(job, rd, fresh=False)

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
        log.info("reattach: %d active job(s), %d to probe", len(active), len(self.reattaching))

    def reattach_one(self, job: Job) -> None:
        try:
            self.ledger.restore(job.allocation)
        except Conflict as exc:
            log.error("job %d: its allocation conflicts with this node's (%s); NOT adopting "
                      "it: marked lost, its supervisor (pid %s) is left alone", job.id, exc,
                      job.supervisor_pid)
            self.lose(job, f"not adopted after an agent restart: allocation conflict: {exc}")
            return
        self.holding.add(job.id)
        rd = self.layout.run_dir(job.id, job.attempt)
        if not os.path.isdir(rd.path):
            if job.state == "running":
                self.lose(job, f"its run directory {rd.path} disappeared while it ran")
            else:
                self.requeue_or_cancel(job, "no run directory: it was never spawned, or its "
                                            "supervisor gave up before launching")
            return
        if fallback.lock_is_free(rd):
            self.gone(job)
            return
        self.reattaching.add(job.id)
        self.connect(job, rd, fresh=False)

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
            self.ack(self.open_link(rd.job, rd.attempt, rd.agent_sock(), track=False))
            return
        log.error("a live supervisor in %s serves no attempt this agent knows about; leaving "
                  "it alone", rd.path)


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

