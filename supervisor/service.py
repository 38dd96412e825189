"""The supervisor's one event loop (I/O).

Theory of operation. One thread polls three things: the ROUTER socket (agent, CLI, tools), the
read end of a socketpair that signal handlers wake (``signal.set_wakeup_fd``: the handlers
themselves do nothing), and a heap of timers. Nothing blocks anywhere else.

Races this loop is built around:
- A task's exit and a request about it arrive in the same wake-up: signals are handled first, so
  a reply never reports a task alive that has already been reaped.
- SIGCHLD coalesces: every wake-up drains ``waitid`` until nothing is left.
- A task leader that exits leaves its process group behind: the group is SIGKILLed while the
  leader is still an unreaped zombie (``WNOWAIT``), so the group id cannot have been reused.
- Daemons that left the group (setsid) are re-parented to us, a child subreaper: once the last
  task is gone, every remaining child is killed by pid, which is safe because an unreaped child's
  pid cannot be reused.
- The exit record is durable (fsync, rename) before anyone is told the step ended.

Followers (the ``output`` and ``events`` long polls). An event wakes its waiters at once
(``on_event``). Output growth has no kernel wake-up here, so the files' sizes are checked every
``FOLLOW_POLL`` seconds, and only while some follower is parked: nobody following, no timer.
When the step ends every parked follower is answered. An ``ack`` does not end the process while
a follower is still reading (parked, or answered without ``ended`` within ``STREAM_IDLE``): the
supervisor stays, at most ``ACK_LINGER`` seconds, so that followers can read to the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

import tether
from tether.shared import faults, protocol, records, wire
from tether.shared.cgroup import CgroupError, StepCgroup
from tether.shared.door import Conn, Door, answer, listen_socket
from tether.shared.errors import LaunchError, StateError, TetherError
from tether.shared.parking import Lot, Parked
from tether.shared.paths import RunDir
from tether.shared.procid import ProcId, all_processes
from tether.shared.timers import Timer, Timers, rfc3339_now
from tether.supervisor import handlers, handover, introspect
from tether.supervisor.launch import Launcher, LaunchFailed, Opened, Opener, output_paths
from tether.supervisor.pmi import Abort, Broken, Finalized, Output, PmiServer, ProtocolError, Send
from tether.supervisor.pmi_io import PmiChannels, clean_env
from tether.supervisor.step import Phase, Step, bounded, signal_name
from tether.supervisor.sweeper import HOLD, HOLD_SCAN, Scan, Sweeper

log = logging.getLogger("tether.supervisor")

#: How long to wait for killed leftovers to be reaped before writing the record anyway.
DRAIN_TIMEOUT = 10.0
#: How often a step's cgroup is looked at while its killed processes leave it.
DRAIN_POLL = 0.005
#: How long the opener (the job's user's files) may take before the launch fails.
OPEN_TIMEOUT = 5.0
#: How long the final reply (to ack) may take to leave before the socket is dropped.
CLOSE_LINGER_MS = 1000
#: seconds between attempts to write an exit record that could not be written (a full disk)
RECORD_RETRY = 1.0
MAX_HOLD = 600.0
#: How long a ``pids`` or ``stats`` request waits for its /proc scan before it is answered busy.
SCAN_HOLD = 10.0
#: How often parked output followers' files are checked for growth (only while any is parked).
FOLLOW_POLL = 0.05
#: The longest an acknowledged supervisor stays up for followers still reading.
ACK_LINGER = 5.0
#: A follower answered without ``ended`` counts as still reading for this long.
STREAM_IDLE = 2.0
TERMINATING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
IGNORED_SIGNALS = (signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)



Peer = handlers.Peer
#: computes a reply from a /proc scan's processes (``after_scan``)
ScanReply = Callable[[list[introspect.ProcSample]], Any]


@dataclass(frozen=True)
class Follow:
    """What a parked ``output`` follow request wants."""

    streams: tuple[str, ...]
    offsets: dict[str, int]


class Supervisor:
    def __init__(self, rd: RunDir, spec: dict[str, Any], lock_fd: int,
                 ready_fd: int = -1) -> None:
        self.rd = rd
        self.spec = spec
        self.lock_fd = lock_fd
        #: the agent's ready pipe: one byte once the socket is bound, so that the agent connects
        #: then, and its hello and claim arrive at once rather than at a reconnect retry
        self.ready_fd = ready_fd
        #: "warm" (forked from the template) or "cold" (a Python start of its own)
        self.start_kind = "cold"
        self.step = Step(job=rd.job, attempt=rd.attempt, ntasks=spec["ntasks"])
        self.pmi: PmiServer | None = None
        self.channels: PmiChannels | None = None
        if spec.get("pmi", "none") != "none":
            self.pmi = PmiServer(size=spec["ntasks"], jobid=f"{rd.job}.{rd.attempt}",
                                 kvsname=f"tether-{rd.job}.{rd.attempt}")
            self.channels = PmiChannels(self.pmi)
            self.launcher = Launcher(self.channels.prepare, self.channels.spawned, clean_env)
        else:
            self.launcher = Launcher()
        #: the step's cgroup (mode none: tracked by process group and session alone)
        self.cgroup = StepCgroup(spec.get("cgroup") or {"mode": "none"})
        #: the job's owner: its tasks' uid (``--user``), else the agent's
        self.owner_uid = int(spec.get("uid", spec["agent_uid"]))
        #: the step's events, in order (``events`` verb): task started, task exited, step ended
        self.events: list[dict[str, Any]] = []
        self.poller = zmq.Poller()
        self.pmi_socks: dict[int, socket.socket] = {}  # rank -> our end, as registered
        self.timers = Timers()
        self.ident = ProcId.of(os.getpid())
        self.session = os.getsid(0)
        #: parked ``wait`` (the agent), ``output`` follows and ``events`` (value: ``after``)
        self.waiters: Lot[None, None] = Lot(self.timers)
        #: ``claim`` requests waiting for the opener and the launch
        self.claims: Lot[None, None] = Lot(self.timers)
        self.opener: Opener | None = None
        self.opener_timer: Timer | None = None
        self.followers: Lot[None, Follow] = Lot(self.timers)
        self.event_waiters: Lot[None, int] = Lot(self.timers)
        self.record: dict[str, Any] | None = None
        self.running = True
        self.remove_rundir = False
        #: the exit record is on disk (fsync'd); until then only this process holds it
        self.record_durable = False
        self.kill_timer: Timer | None = None
        #: the job's time limit, armed at launch: SIGTERM, then SIGKILL after the grace
        self.limit_timer: Timer | None = None
        self.drain_timer: Timer | None = None
        self.drain_check: Timer | None = None
        #: finds leftover children while draining, off the loop (sweeper.py)
        self.sweeper = Sweeper(rd.path if faults.supervisor_fault(HOLD) else None)
        #: children found by the last scan, killed and not yet reaped
        self.leftovers = 0
        me, session = os.getpid(), os.getsid(0)
        #: the /proc scans behind ``pids`` and ``stats``, off the loop; ``scan_seq`` numbers
        #: them (the one running or last started), and requests wait under the one they need
        self.scans = Scan(lambda: introspect.snapshot(me, session),
                          (rd.path, "scan") if faults.supervisor_fault(HOLD_SCAN) else None)
        self.scan_seq = 0
        self.scan_waiters: Lot[int, ScanReply] = Lot(self.timers)
        self.claim_timer: Timer | None = None
        self.router: zmq.Socket[Any] | None = None
        self.door: Door | None = None
        self.follow_timer: Timer | None = None
        #: (peer key, verb) -> when a follower was last answered without ``ended``
        self.streams: dict[tuple[Any, str], float] = {}
        #: the output files' sizes when the step ended: what ``ended`` means for followers
        self.final_sizes: dict[str, int] | None = None
        #: rank -> CLOCK_BOOTTIME seconds when the task was reaped (for ``stats``' elapsed)
        self.task_end_boottime: dict[int, float] = {}
        self.ack_deadline: float | None = None
        #: how many times this process re-executed itself (``upgrade``): same pid, new image
        self.generation = 0
        #: the listening socket the ROUTER is bound on; kept across exec (handover.py)
        self.listen_fd = -1
        #: the door's listening socket; kept across exec too. -1 after resuming from an image
        #: of before the doors (handover format 1): that one keeps its ROUTER on ``sock``
        self.door_fd = -1
        self.upgrade_requested = False
        #: the release this process ran before its last re-exec, if any
        self.upgraded_from: str | None = None
        self.resumed = False

    # ---- loop ------------------------------------------------------------------------------

    def run(self) -> int:
        reset_signal_dispositions(unblock=False)
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        # Python-level handlers only (exec resets them, so tasks start with defaults). Stray
        # SIGQUIT/SIGUSR1/SIGUSR2 must not kill the step's supervisor: they are logged.
        for sig in (signal.SIGCHLD, *TERMINATING, *IGNORED_SIGNALS):
            signal.signal(sig, _wake_only)
        # only now: a re-executed supervisor arrives with these blocked (handover.py)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        ctx: zmq.Context[Any] = zmq.Context()
        # ZeroMQ for the agent only, inside ctl/ (0700): no other user can even connect to it.
        # People come through the door, where every request is authorized per verb. Both
        # listening sockets are kept across an upgrade's exec (handover.py).
        if self.listen_fd < 0:
            private_dir(self.rd.ctl)
            old_umask = os.umask(0o077)
            try:
                self.listen_fd = handover.listen(self.rd.ctl_sock)
            finally:
                os.umask(old_umask)
            self.door_fd = listen_socket(self.rd.sock)
        self.router = handover.bind_router(ctx, self.router_path(), self.listen_fd)
        self.door = self.open_door()
        # The agent may connect now: its hello is queued by ZeroMQ while the manifest's fsyncs
        # run, and answered after them (the manifest's "ready" is not something it waits for).
        self.signal_ready()
        self.write_manifest()
        if self.resumed:
            log.info("re-executed as tether %s (was %s), generation %d; serving %s again",
                     tether.__version__, self.upgraded_from, self.generation, self.rd.sock)
            if self.step.phase in (Phase.RUNNING, Phase.DRAINING):
                self.reap()  # a task may have ended while signals were blocked
        else:
            self.claim_timer = self.timers.at(
                time.monotonic() + float(self.spec["claim_timeout"]), self.claim_expired)
            log.info("ready on %s (%s start); waiting up to %gs for the agent's claim",
                     self.rd.sock, self.start_kind, self.spec["claim_timeout"])
        poller = self.poller
        poller.register(self.router, zmq.POLLIN)
        poller.register(wake_r, zmq.POLLIN)
        poller.register(self.sweeper.fileno(), zmq.POLLIN)
        poller.register(self.scans.fileno(), zmq.POLLIN)
        if self.door is not None:
            poller.register(self.door.fileno(), zmq.POLLIN)
        status = 0
        try:
            while self.running:
                events = dict(poller.poll(self.timers.timeout_ms(time.monotonic())))
                try:
                    if wake_r.fileno() in events:
                        self.on_signals(wake_r)
                    if self.router in events:
                        self.serve()
                    if self.door is not None and self.door.fileno() in events:
                        self.door.service()
                    if self.opener is not None and self.opener.sock.fileno() in events:
                        self.opener_ready()
                    if self.sweeper.fileno() in events:
                        self.swept()
                    if self.scans.fileno() in events:
                        self.scanned()
                    if self.upgrade_requested:
                        self.upgrade_requested = False
                        ctx = self.reexec(ctx)  # returns only if exec failed
                    if self.channels is not None:
                        self.pmi_events(events)
                    self.timers.run_due(time.monotonic())
                except Exception:
                    # Crash-only: requests and launches handle their own errors; anything else
                    # means this process cannot be trusted to go on. Its tasks are killed, so
                    # none runs untracked, and the agent gives the verdict from the run
                    # directory (lost: the manifest says the tasks ran).
                    log.exception("the supervisor cannot go on; killing the step's tasks and "
                                  "exiting")
                    self.give_up()
                    status = 3
                    break
        finally:
            if self.door is not None:
                self.door.close()
            self.router.close(linger=CLOSE_LINGER_MS)
            ctx.term()
            os.close(self.listen_fd)
            if self.door_fd >= 0:
                os.close(self.door_fd)
            if self.channels is not None:
                self.channels.close_all()
            self.sweeper.close()
            self.scans.close()
            if self.remove_rundir:
                shutil.rmtree(self.rd.path, ignore_errors=True)
            else:
                _unlink(self.rd.ctl_sock)
        log.info("supervisor exits")
        return status

    def give_up(self) -> None:
        for task in self.step.tasks:
            if task.pid and not task.done:
                _killpg(task.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.kill_cgroup()
        with contextlib.suppress(Exception):
            self.sweep_now()

    def signal_ready(self) -> None:
        if self.ready_fd < 0:
            return
        try:
            os.write(self.ready_fd, b"r")
        except OSError as exc:  # the agent went away: a restarted one finds us by the lock
            log.info("ready pipe: %s", exc)
        os.close(self.ready_fd)
        self.ready_fd = -1

    def serve(self) -> None:
        """The agent's requests, on the ZeroMQ ROUTER in ctl/."""
        assert self.router is not None
        while (msg := wire.receive(self.router)) is not None:
            self.handle(*msg)

    def on_door_request(self, conn: Conn, req: protocol.Request) -> None:
        self.handle(conn, req)

    def on_door_close(self, conn: Conn) -> None:
        for lot in (self.waiters, self.followers, self.event_waiters, self.claims,
                    self.scan_waiters):
            lot.drop_peer(conn.key)

    def handle(self, peer: Peer, req: protocol.Request) -> None:
        """One request from either transport: the same verbs, the same authorization."""
        answer(lambda: handlers.dispatch(self, peer, req), req, peer,
               lambda r: self.reply(peer, r), log, handlers.PENDING, self.door)

    def after_scan(self, peer: Peer, rid: protocol.RequestId, compute: ScanReply) -> None:
        """Answer a request with ``compute(processes)`` from a /proc scan that begins after
        it (``pids``, ``stats``): the scan runs on a thread, the reply is computed here."""
        if not self.scans.busy:
            self.scan_seq += 1
        need = self.scan_seq if not self.scans.busy else self.scan_seq + 1
        self.scans.start()  # now, or as the next one when the running one is in
        self.scan_waiters.park(need, peer, rid, SCAN_HOLD, compute, lambda p: self.reply(
            p.peer, protocol.error(p.rid, TetherError(
                f"reading /proc took longer than {SCAN_HOLD:g}s; try again"))))

    def scanned(self) -> None:
        try:
            procs, failed = self.scans.result(), None
        except OSError as exc:
            procs, failed = [], TetherError(f"cannot read /proc: {exc}")
        for p in self.scan_waiters.take(self.scan_seq):
            try:
                if failed is not None:
                    raise failed
                reply = protocol.ok(p.rid, p.value(procs))
            except TetherError as exc:
                reply = protocol.error(p.rid, exc)
            except Exception:  # as for any handler: a bug is answered, never sent
                log.exception("computing a reply from a /proc scan")
                reply = protocol.error(p.rid, TetherError("internal error"))
            self.reply(p.peer, reply)
        if self.scans.again:
            self.scan_seq += 1
            self.scans.start()

    def reply(self, peer: Peer, reply: protocol.Reply) -> None:
        if isinstance(peer, Conn):
            if self.door is not None:
                self.door.send(peer, reply)
        elif self.router is not None:
            wire.send(self.router, peer, reply)

    def on_signals(self, wake_r: socket.socket) -> None:
        got: set[int] = set()
        while True:
            try:
                data = wake_r.recv(4096)
            except BlockingIOError:
                break
            if not data:
                break
            got.update(data)
        if signal.SIGCHLD in got or self.step.phase in (Phase.RUNNING, Phase.DRAINING):
            self.reap()
        for sig in got & set(IGNORED_SIGNALS):
            log.warning("received %s: ignored", signal_name(sig))
            if sig == signal.SIGUSR2 and faults.supervisor_fault("error-on-usr2"):
                raise RuntimeError("test fault: an error nothing in the loop expects")
        for sig in got & set(TERMINATING):
            log.warning("received %s: terminating the step", signal_name(sig))
            self.terminate(grace=float(self.spec.get("kill_grace", 10)), cancel=False,
                           why=f"supervisor received {signal_name(sig)}")

    # ---- re-executing into the installed release (handover.py) ------------------------------

    def restore(self, state: dict[str, Any], upgraded_from: str) -> None:
        """Take over the state the previous image of this process handed across exec."""
        self.resumed = True
        self.upgraded_from = upgraded_from
        self.generation = int(state["generation"])
        self.step = state["step"]
        self.events = state["events"]
        self.record = state["record"]
        self.final_sizes = state["final_sizes"]
        self.task_end_boottime = state["task_end_boottime"]
        self.launcher.readers = dict(state["readers"])
        self.listen_fd = int(state["listen_fd"])
        self.door_fd = int(state.get("door_fd", -1))
        for fd in handover.kept_fds(state, self.lock_fd):
            os.set_inheritable(fd, False)  # a task started later must not inherit any
        if state["pmi"] is not None:
            self.pmi = state["pmi"]["server"]
            assert self.pmi is not None
            self.channels = PmiChannels(self.pmi)
            for rank, fd in state["pmi"]["ours"].items():
                sock = socket.socket(fileno=fd)
                sock.setblocking(False)
                self.channels.ours[int(rank)] = sock
            for rank, data in state["pmi"]["pending"].items():
                self.channels.pending[int(rank)] = bytearray(data)
            self.sync_pmi_registrations()
        timers = state["timers"]
        if "claim" in timers:
            self.claim_timer = self.timers.at(timers["claim"], self.claim_expired)
        if "kill" in timers:
            self.kill_timer = self.timers.at(timers["kill"], self.kill_now)
        if "limit" in timers:
            self.limit_timer = self.timers.at(timers["limit"], self.time_limit_reached)

    def request_upgrade(self) -> str:
        """The ``upgrade`` verb: check the installed build can take over; exec after the reply."""
        if self.step.phase not in (Phase.READY, Phase.RUNNING):
            raise StateError(f"step {self.rd.job}.{self.rd.attempt} is "
                             f"{self.step.phase.value}: there is nothing left to upgrade")
        try:
            # Blocks the loop for one interpreter start (~0.2 s): an operator's explicit act,
            # and it proves the installed build starts before this process bets its life on it.
            target = handover.probe_installed()
        except handover.HandoverError as exc:
            raise StateError(f"not upgrading: {exc}") from None
        self.upgrade_requested = True
        return target

    def router_path(self) -> str:
        """Where the ROUTER listens: ``ctl/sock``; for an image resumed from before the doors,
        ``sock``, where that one bound it (its listening socket came across the exec)."""
        return self.rd.ctl_sock if self.door_fd >= 0 else self.rd.sock

    def open_door(self) -> Door | None:
        if self.door_fd < 0:
            return None
        return Door(self.rd.sock, self.timers, self.on_door_request, name="supervisor door",
                    log=log, on_close=self.on_door_close, listen_fd=self.door_fd,
                    privileged=frozenset({0, os.getuid(), int(self.spec["agent_uid"])}))

    def reexec(self, ctx: zmq.Context[Any]) -> zmq.Context[Any]:
        """Answer everything parked, hand the state over and exec. Returns only on failure."""
        assert self.router is not None
        for p in self.waiters.take(None):
            self.reply(p.peer, protocol.ok(p.rid, {"done": False, "upgrading": True}))
        for f in self.followers.take(None):
            self.answer_follower(f, upgrading=True)
        for w in self.event_waiters.take(None):
            self.answer_event_waiter(w, upgrading=True)
        if self.opener is not None:  # a launch still opening files: the agent claims again
            self.opener.kill()
            self.drop_opener()
        for p in self.claims.take(None):
            self.reply(p.peer, protocol.error(p.rid, LaunchError("upgrading; claim again")))
        state = handover.capture(self)
        state_fd = handover.write_state(state)
        keep = handover.kept_fds(state, self.lock_fd)
        blocked = {signal.SIGCHLD, *TERMINATING, *IGNORED_SIGNALS}
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        self.poller.unregister(self.router)
        self.router.close(linger=CLOSE_LINGER_MS)  # the replies above leave first
        ctx.term()
        if self.door is not None:  # its listening socket stays open (door_fd) for the next image
            self.poller.unregister(self.door.fileno())
            self.door.close(unlink=False)
            self.door = None
        for fd in keep:
            os.set_inheritable(fd, True)
        log.info("re-executing into the installed tether (generation %d)", self.generation + 1)
        try:
            os.execv(sys.executable, handover.argv(self, state_fd))
        except OSError as exc:
            log.error("exec failed: %s; carrying on as tether %s", exc, tether.__version__)
        for fd in keep:
            os.set_inheritable(fd, False)
        os.close(state_fd)
        ctx = zmq.Context()
        self.router = handover.bind_router(ctx, self.router_path(), self.listen_fd)
        self.poller.register(self.router, zmq.POLLIN)
        self.door = self.open_door()
        if self.door is not None:
            self.poller.register(self.door.fileno(), zmq.POLLIN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
        return ctx

    # ---- launch ----------------------------------------------------------------------------

    def claim(self, peer: Peer, rid: protocol.RequestId) -> None:
        """The first valid claim starts the opener; every claim is answered once the tasks
        have started (or the launch failed). The step stays ``ready`` meanwhile, so an abort
        still wins, and the claim deadline no longer runs."""
        self.claims.park(None, peer, rid, OPEN_TIMEOUT + 5.0, None, lambda p: self.reply(
            p.peer, protocol.error(p.rid, LaunchError("the launch is still opening files"))))
        if self.opener is not None:
            return
        if self.claim_timer:
            self.claim_timer.cancel()
        try:
            self.opener = Opener(self.spec, output_paths(self.spec))
        except OSError as exc:
            self.opened(LaunchFailed(f"cannot start the output opener: {exc}"))
            return
        self.poller.register(self.opener.sock, zmq.POLLIN)
        self.opener_timer = self.timers.at(time.monotonic() + OPEN_TIMEOUT, self.opener_late)

    def opener_ready(self) -> None:
        assert self.opener is not None
        try:
            got: Opened | LaunchFailed = self.opener.result()
        except LaunchFailed as exc:
            got = exc
        self.opened(got)

    def opener_late(self) -> None:
        if self.opener is not None:
            self.opener.kill()
            self.opened(LaunchFailed(f"the output files could not be opened as "
                                     f"{self.spec.get('user')} within {OPEN_TIMEOUT:g}s"))

    def drop_opener(self) -> None:
        if self.opener is not None:
            with contextlib.suppress(KeyError):
                self.poller.unregister(self.opener.sock)
            self.opener.close()
            self.opener = None
        if self.opener_timer is not None:
            self.opener_timer.cancel()
            self.opener_timer = None

    def opened(self, got: Opened | LaunchFailed) -> None:
        """Launch on what the opener handed back: phase ready -> running.

        The manifest says ``launching`` durably *before* the first fork: if this process dies
        while forking, the agent must find "tasks may be running" (lost, leftovers killed), never
        "never ran" (requeued, and run a second time beside the first).
        """
        self.drop_opener()
        if self.step.phase is not Phase.READY:  # aborted meanwhile: nothing starts
            if isinstance(got, Opened):
                got.close()
                for r in got.readers:
                    if r is not None:
                        os.close(r)
            self.answer_claims()
            return
        if not self.write_manifest(launching=True):
            if isinstance(got, Opened):
                got.close()
            err = LaunchError(f"cannot record the launch in {self.rd.manifest}; not starting")
            for p in self.claims.take(None):
                self.reply(p.peer, protocol.error(p.rid, err))
            return
        self.step.advance(Phase.RUNNING)
        self.step.started_at = rfc3339_now()
        self.make_cgroup()
        limit = self.spec.get("time_limit")
        if isinstance(limit, int | float) and not isinstance(limit, bool) and limit > 0:
            # Counted from the launch, by this process: the agent may be gone when it runs out.
            self.step.launched_mono = time.monotonic()
            self.limit_timer = self.timers.at(time.monotonic() + float(limit),
                                              self.time_limit_reached)
        try:
            self.launcher.launch(self.spec, self.step, got)
        except LaunchFailed as exc:
            log.warning("launch failed: %s", exc)
            for task in self.step.tasks:
                if task.pid and not task.done:
                    _killpg(task.pid, signal.SIGKILL)
        except Exception as exc:  # EMFILE, ENOMEM, a bug: never a half-started step
            log.exception("launch failed")
            self.fail_launch(f"launch failed: {exc}")
        self.sync_pmi_registrations()
        for task in self.step.tasks:
            if task.pid:
                self.emit("task_started", rank=task.rank, pid=task.pid)
        if faults.supervisor_fault("die-after-launch"):
            os.kill(os.getpid(), signal.SIGKILL)  # test-only: the crash window before "running"
        self.write_manifest()
        log.info("launched %d task(s): pids %s", self.step.ntasks,
                 [t.pid for t in self.step.tasks])
        self.answer_claims()
        self.reap()  # a launch failure may already have finished the step

    def make_cgroup(self) -> None:
        """The step's cgroup, before the first fork; the launcher puts each task in it."""
        if not self.cgroup.active:
            return
        try:
            self.cgroup.create()
        except CgroupError as exc:
            # Never a failed launch for want of containment: tracked as without cgroups.
            log.error("%s; the step runs without one (tracked by process group and session)",
                      exc)
            self.cgroup.remove()
            self.cgroup = StepCgroup({"mode": "none"})
            return
        self.launcher.contain = self.cgroup.joined

    def kill_cgroup(self) -> None:
        if self.cgroup.active:
            self.cgroup.kill()

    def answer_claims(self) -> None:
        for p in self.claims.take(None):
            if self.step.phase is Phase.ABORTED:
                self.reply(p.peer, protocol.error(p.rid, StateError(
                    f"step {self.rd.job}.{self.rd.attempt} was aborted before launch: "
                    f"{self.step.abort_reason}")))
            else:
                self.reply(p.peer, protocol.ok(p.rid, handlers.claim_result(self)))

    def fail_launch(self, reason: str) -> None:
        """The tasks already started are killed, the rest never start, and the first of those
        carries ``reason`` into the exit record (exit code 127, like a failed exec)."""
        if self.pmi is not None:
            self.pmi.step_failing(reason)
        told = False
        for task in self.step.tasks:
            if task.done:
                continue
            if task.pid:
                task.killed_by_step = True
                _killpg(task.pid, signal.SIGKILL)
            elif not told:
                task.record_launch_failure(reason)
                self.step.note_exit(task)
                told = True
            else:
                task.done = True
                task.reason = bounded(f"not started: {reason}")
        if not told:  # every task had started: the step fails for this reason all the same
            self.step.force_failure(reason)

    def claim_expired(self) -> None:
        if self.step.phase is not Phase.READY:
            return
        self.abort(f"no agent claimed the step within {self.spec['claim_timeout']:g}s",
                   cancel=False, keep_record=True)

    def abort(self, reason: str, *, cancel: bool, keep_record: bool) -> None:
        """Give up before launching: nothing ran. ``keep_record`` leaves a sentinel saying so."""
        self.step.advance(Phase.ABORTED)
        self.step.cancelled = cancel
        self.step.abort_reason = reason
        self.step.ended_at = rfc3339_now()
        log.warning("aborted before launch: %s", reason)
        if keep_record:
            self.write_record()
        else:
            self.record = self.build_record()
            self.remove_rundir = True
        if self.opener is not None:
            self.opener.kill()
            self.drop_opener()
        self.answer_claims()
        self.release_waiters()
        self.running = False

    # ---- end of the step -------------------------------------------------------------------

    def reap(self) -> None:
        by_pid = {t.pid: t for t in self.step.tasks if t.pid and not t.done}
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
            if info is None or info.si_pid == 0:
                break
            pid = info.si_pid
            task = by_pid.pop(pid, None)
            if task is not None:
                # The leader is a zombie, so its pid (= its group id) is still ours to kill.
                _killpg(pid, signal.SIGKILL)
            try:
                _, status, rusage = os.wait4(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            self.sweeper.note_reaped(pid)
            self.launcher.reaped(pid, status)
            if task is not None:
                task.record_status(status, rusage)
                self.step.note_exit(task)
                how = (f"killed by {signal_name(task.signal)}" if task.signal is not None
                       else f"exited with code {task.exit_code}")
                log.info("task %d (pid %d) %s", task.rank, pid, how)
                self.emit("task_exited", rank=task.rank, pid=pid, exit_code=task.exit_code,
                          signal=task.signal)
                if self.pmi is not None:
                    self.handle_pmi(self.pmi.rank_exited(task.rank, not task.failed))
                    if task.failed:
                        # MPI semantics: one failed rank ends the step; the rest are killed.
                        self.kill_ranks(f"rank {task.rank} {how}")
        if self.step.phase is Phase.RUNNING and self.step.all_done:
            self.step.advance(Phase.DRAINING)
            if self.kill_timer:
                self.kill_timer.cancel()
            if self.limit_timer:
                self.limit_timer.cancel()
                self.limit_timer = None
            self.drain_timer = self.timers.at(time.monotonic() + DRAIN_TIMEOUT, self.finish)
        if self.step.phase is Phase.DRAINING:
            self.cgroup_drained()  # kills what is left in the cgroup, the sooner the better
            self.sweeper.start()  # answered in swept(), on this loop

    def cgroup_drained(self) -> bool:
        """Is the step's cgroup empty? If not, kill what is in it and look again shortly (a
        killed process that is not our child sends no SIGCHLD)."""
        if not self.cgroup.active or self.cgroup.empty():
            return True
        self.cgroup.kill()
        if self.cgroup.empty():
            return True
        if self.drain_check is None:
            def again() -> None:
                self.drain_check = None
                self.reap()
            self.drain_check = self.timers.at(time.monotonic() + DRAIN_POLL, again)
        return False

    def swept(self) -> None:
        """The scan for leftover children is in: SIGKILL them; the step ends once a scan
        that no reap overtook finds none. Their deaths reap, and reaping scans again."""
        try:
            found = self.sweeper.result()
        except OSError as exc:  # /proc unreadable: the drain timer still ends the step
            log.error("cannot look for leftover processes: %s", exc)
            return
        for f in found:
            if f.dead:
                continue
            try:
                os.kill(f.pid, signal.SIGKILL)  # unreaped, so still our child: safe by pid
                log.info("killed leftover process %d", f.pid)
            except OSError as exc:  # gone meanwhile, or setuid: counted, logged
                log.warning("cannot kill leftover process %d: %s", f.pid, exc)
        self.leftovers = len(found)
        if self.step.phase is not Phase.DRAINING:
            return
        if self.sweeper.again:
            self.sweeper.start()
        elif not found and self.cgroup_drained():
            self.finish()

    def sweep_now(self) -> int:
        """SIGKILL every remaining child (adopted daemons), on the spot; return how many are
        left. Only for a supervisor giving up: nothing reaps meanwhile, nothing waits."""
        me = os.getpid()
        left = 0
        for st in all_processes():
            if st.ppid == me:
                left += 1
                if not st.dead:
                    try:
                        os.kill(st.pid, signal.SIGKILL)
                        log.info("killed leftover process %d", st.pid)
                    except OSError as exc:  # gone meanwhile, or setuid: counted, logged
                        log.warning("cannot kill leftover process %d: %s", st.pid, exc)
        return left

    def finish(self) -> None:
        if self.step.phase is not Phase.DRAINING:
            return
        if self.drain_timer:
            self.drain_timer.cancel()
        left = self.leftovers
        if left:
            log.error("%d leftover process(es) survived SIGKILL for %gs; ending the step anyway",
                      left, DRAIN_TIMEOUT)
        if self.drain_check is not None:
            self.drain_check.cancel()
            self.drain_check = None
        if self.cgroup.active:
            if not self.cgroup.empty():
                log.error("processes %s are still in the step's cgroup after %gs; ending the "
                          "step anyway", sorted(self.cgroup.procs()), DRAIN_TIMEOUT)
            if self.cgroup.oom_kills() and self.cgroup.memory_mb:
                self.step.oom_mb = self.cgroup.memory_mb
                log.warning("the OOM killer took %d process(es) of the step (limit %d MB)",
                            self.cgroup.oom_kills(), self.cgroup.memory_mb)
        self.step.ended_at = rfc3339_now()
        self.step.advance(Phase.EXITED)
        self.write_record()
        if self.cgroup.active and not self.cgroup.remove():
            log.error("cannot remove the step's cgroup %s", self.cgroup.dirs)
        log.info("step ended: %s", self.record)
        assert self.record is not None
        self.emit("step_ended", state=self.record["state"], exit_code=self.record["exit_code"],
                  signal=self.record["signal"], reason=self.record["reason"])
        self.release_waiters()
        linger = float(self.spec["linger"])
        self.timers.at(time.monotonic() + linger, self.linger_expired)

    def linger_expired(self) -> None:
        if not self.record_durable:
            # The result exists only in this process: exiting would lose it.
            log.warning("no agent acknowledged the result and it is not on disk yet; "
                        "staying another %gs", self.spec["linger"])
            self.timers.at(time.monotonic() + float(self.spec["linger"]), self.linger_expired)
            return
        log.warning("no agent acknowledged the result within %gs; exiting and leaving the "
                    "exit record at %s", self.spec["linger"], self.rd.sentinel)
        self.running = False

    def acknowledged(self) -> None:
        self.remove_rundir = True
        if self.ack_deadline is not None:
            return  # already lingering for followers
        if self.streams_active():
            log.info("acknowledged; staying up to %gs while followers read to the end",
                     ACK_LINGER)
            self.ack_deadline = time.monotonic() + ACK_LINGER
            self.timers.at(time.monotonic() + FOLLOW_POLL, self.ack_linger_check)
            return
        self.running = False

    def ack_linger_check(self) -> None:
        assert self.ack_deadline is not None
        if not self.streams_active():
            self.running = False
        elif time.monotonic() >= self.ack_deadline:
            log.warning("followers still reading %gs after the acknowledgement; exiting",
                        ACK_LINGER)
            self.running = False
        else:
            self.timers.at(time.monotonic() + FOLLOW_POLL, self.ack_linger_check)

    def terminate(self, *, grace: float, cancel: bool, why: str) -> None:
        phase = self.step.phase
        if phase is Phase.READY:
            self.abort(why, cancel=cancel, keep_record=False)
            return
        if phase is not Phase.RUNNING:
            return
        if cancel:
            self.step.cancelled = True
        elif self.step.terminated_by is None:
            self.step.terminated_by = why
        for pid in self.step.live_pids():
            _killpg(pid, signal.SIGTERM)
        if self.cgroup.active:
            # every process of the step hears it (a setsid daemon too); a suspended step is
            # thawed so that it can
            self.cgroup.signal_all(signal.SIGTERM)
            with contextlib.suppress(CgroupError):
                self.cgroup.thaw()
        if self.kill_timer is None:
            self.kill_timer = self.timers.at(time.monotonic() + grace, self.kill_now)
            log.info("%s: sent SIGTERM, SIGKILL in %gs", why, grace)

    def time_limit_reached(self) -> None:
        self.limit_timer = None
        if self.step.phase is not Phase.RUNNING or self.step.cancelled:
            return
        more = self.suspension_owed()
        if more > 0:  # time suspended is not run time: the limit moves on
            log.debug("time limit: %.1fs more for the time the job was suspended", more)
            self.limit_timer = self.timers.at(time.monotonic() + more, self.time_limit_reached)
            return
        limit = float(self.spec["time_limit"])
        self.step.timed_out = True
        self.terminate(grace=float(self.spec.get("kill_grace", 10)), cancel=False,
                       why=f"time limit of {_limit_text(limit)} reached")

    def suspension_owed(self) -> float:
        """How much longer the time limit must wait because the job was suspended: time
        suspended is not run time. The agent freezes the step and keeps the account in the run
        directory (``suspension.json``: seconds in all, and since when while suspended). While
        suspended: look again in a second. 0 when none is owed (or no account is readable)."""
        launched = getattr(self.step, "launched_mono", None)
        try:
            rec = records.read_json(self.rd.suspension, max_bytes=4096)
            seconds = float(rec.get("seconds", 0))
            since = rec.get("since")
        except (OSError, ValueError, TypeError, records.RecordError):
            return 0.0
        if since is not None and self.cgroup.active and self.cgroup.frozen():
            return 1.0
        if launched is None:
            return 0.0
        ran = time.monotonic() - launched - seconds
        owed = float(self.spec["time_limit"]) - ran
        return owed if owed > 0.01 else 0.0

    def kill_now(self) -> None:
        for task in self.step.tasks:
            if task.pid and not task.done:
                log.warning("task %d (pid %d) outlived the grace period; sending SIGKILL",
                            task.rank, task.pid)
                _killpg(task.pid, signal.SIGKILL)
        self.kill_cgroup()

    # ---- PMI -------------------------------------------------------------------------------

    def pmi_events(self, events: dict[Any, int]) -> None:
        assert self.channels is not None
        ours = [(fd, rank) for fd, rank in self.channels.fd_ranks().items() if fd in events]
        for fd, rank in ours:
            flags = events[fd]
            if flags & zmq.POLLIN:
                self.handle_pmi(self.channels.readable(rank))
            if flags & zmq.POLLOUT:
                self.channels.flush(rank)
        if ours:
            self.sync_pmi_registrations()

    def sync_pmi_registrations(self) -> None:
        """Keep the poller's view of the PMI fds in step with the channels."""
        if self.channels is None:
            return
        want_write = self.channels.wants_write()
        for rank, sock in list(self.pmi_socks.items()):
            if self.channels.ours.get(rank) is not sock:
                self.poller.unregister(sock)
                del self.pmi_socks[rank]
        for rank, sock in self.channels.ours.items():
            flags = zmq.POLLIN | (zmq.POLLOUT if rank in want_write else 0)
            if rank in self.pmi_socks:
                self.poller.modify(sock, flags)
            else:
                self.poller.register(sock, flags)
                self.pmi_socks[rank] = sock

    def handle_pmi(self, outputs: list[Output]) -> None:
        assert self.channels is not None
        for o in outputs:
            if isinstance(o, Send):
                self.channels.send(o)
            elif isinstance(o, Abort):
                # An abort is a failure whatever code it names: a code outside 1..255 would
                # read as success (0) or be cut to 8 bits by a shell; it becomes 1.
                code = o.code if 1 <= o.code <= 255 else 1
                self.pmi_failure(f"rank {o.rank} called PMI abort with exit code {o.code}"
                                 + (f": {o.message}" if o.message else ""), code)
            elif isinstance(o, ProtocolError):
                msg = o.message if o.message.startswith(f"rank {o.rank} ") else (
                    f"rank {o.rank}: {o.message}")
                self.pmi_failure(f"PMI protocol error: {msg}", None)
            elif isinstance(o, Broken):
                self.pmi_failure(o.message, None)
            elif isinstance(o, Finalized):
                log.debug("rank %d finalized PMI", o.rank)
        self.sync_pmi_registrations()

    def pmi_failure(self, reason: str, exit_code: int | None) -> None:
        if self.step.force_failure(reason, exit_code):
            log.warning("ending the step: %s", reason)
        self.kill_ranks(reason)

    def kill_ranks(self, why: str) -> None:
        if self.pmi is not None:
            self.pmi.step_failing(why)  # before the kills: their deaths are not the cause
        live = self.step.live_pids()
        if live:
            log.warning("%s: killing ranks %s", why,
                        [t.rank for t in self.step.tasks if t.pid in live])
        for task in self.step.tasks:
            if task.pid in live:
                task.killed_by_step = True
                _killpg(task.pid, signal.SIGKILL)

    # ---- records ---------------------------------------------------------------------------

    def build_record(self) -> dict[str, Any]:
        rec = {
            "schema": records.SCHEMA, "job": self.rd.job, "attempt": self.rd.attempt,
            "tasks": [t.to_dict() for t in self.step.tasks],
            "started_at": self.step.started_at, "ended_at": self.step.ended_at,
        }
        rec.update(self.step.outcome())
        return rec

    def write_record(self) -> None:
        self.record = self.build_record()
        self.retry_record()

    def retry_record(self) -> None:
        """Make the exit record durable; while that fails (a full disk) it is served from
        memory and written again every RECORD_RETRY seconds."""
        if self.remove_rundir or not self.running:
            return
        try:
            records.atomic_write_json(self.rd.sentinel, self.record)
            self.record_durable = True
        except OSError as exc:
            log.error("cannot write the exit record %s: %s; trying again in %gs",
                      self.rd.sentinel, exc, RECORD_RETRY)
            self.timers.at(time.monotonic() + RECORD_RETRY, self.retry_record)

    def write_manifest(self, *, launching: bool = False) -> bool:
        assert self.ident is not None
        if launching:
            phase = "launching"
        else:
            phase = "ready" if self.step.phase is Phase.READY else "running"
        man = {
            "schema": records.SCHEMA, "job": self.rd.job, "attempt": self.rd.attempt,
            "phase": phase, "protocol": protocol.PROTOCOL_VERSION, "version": tether.__version__,
            "supervisor": self.ident.to_dict(), "session": self.session,
            "tasks": [{"rank": t.rank, "boot_id": self.ident.boot_id, "pid": t.pid,
                       "start_ticks": t.start_ticks} for t in self.step.tasks if t.pid],
            "cpus": self.spec["cpus"], "gpus": self.spec["gpus"],
            "memory_mb": self.spec["memory_mb"], "output": self.spec["output"],
            "error": self.spec["error"], "socket": self.rd.sock,
            "started_at": self.step.started_at,
        }
        try:
            # Only "launching" must survive a power cut: it is what says tasks may have run
            # (lost, never run again). "ready" and no manifest mean the same (never ran), and
            # "running" adds identities that a reboot makes moot: two fsyncs each, saved.
            records.atomic_write_json(self.rd.manifest, man, durable=launching)
        except OSError as exc:
            log.error("cannot write the manifest %s: %s", self.rd.manifest, exc)
            return False
        return True

    def emit(self, kind: str, **fields: Any) -> None:
        """Append one event; ``on_event`` (the events verb's waiters) is told."""
        event = {"seq": len(self.events) + 1, "time": rfc3339_now(), "kind": kind, **fields}
        self.events.append(event)
        self.on_event(event)

    def on_event(self, event: dict[str, Any]) -> None:
        """Wake the ``events`` verb's waiters; at the step's end, every follower."""
        if event["kind"] == "task_exited":
            self.task_end_boottime[int(event["rank"])] = introspect.boottime()
        if event["kind"] == "step_ended":
            self.step_over()
        else:
            self.wake_event_waiters()

    def step_over(self) -> None:
        """The step has ended (or was aborted): fix the output's final sizes, answer everyone
        parked. Idempotent."""
        if self.final_sizes is None:
            try:
                self.final_sizes = handlers.stream_sizes(self)
            except OSError as exc:
                log.error("cannot stat the output files: %s", exc)
                self.final_sizes = {}
        self.wake_followers(force=True)
        self.wake_event_waiters(force=True)

    # ---- followers (output and events long polls) ---------------------------------------------

    def note_stream(self, peer: Peer, verb: str, ended: bool) -> None:
        """A follower was answered: it is still reading unless it was told ``ended``."""
        key = (peer.key, verb)
        if ended:
            self.streams.pop(key, None)
        else:
            self.streams[key] = time.monotonic()
            if len(self.streams) > 64:
                self.prune_streams()

    def prune_streams(self) -> None:
        """Forget followers that went quiet (detached, or gone without reading to the end)."""
        now = time.monotonic()
        for key, seen in list(self.streams.items()):
            if now - seen > STREAM_IDLE:
                del self.streams[key]

    def streams_active(self) -> bool:
        """Is a follower parked, or was one answered without ``ended`` just now?"""
        self.prune_streams()
        return bool(len(self.followers) or len(self.event_waiters) or self.streams)

    def add_follower(self, peer: Peer, rid: protocol.RequestId, streams: tuple[str, ...],
                     offsets: dict[str, int], hold: float) -> None:
        self.followers.park(None, peer, rid, min(hold, MAX_HOLD), Follow(streams, offsets),
                            self.answer_follower)
        if self.follow_timer is None:
            self.follow_timer = self.timers.at(time.monotonic() + FOLLOW_POLL, self.follow_tick)

    def follow_tick(self) -> None:
        self.follow_timer = None
        self.wake_followers()
        if len(self.followers):
            self.follow_timer = self.timers.at(time.monotonic() + FOLLOW_POLL, self.follow_tick)

    def answer_follower(self, f: Parked[Follow], *, force: bool = True,
                        upgrading: bool = False) -> bool:
        """Answer ``f`` if it has news (or ``force``); True if it was answered."""
        try:
            res = handlers.follow_result(self, f.value.streams, f.value.offsets)
        except TetherError as exc:  # e.g. the file shrank below the offset
            reply = protocol.error(f.rid, exc)
        else:
            if not force and not handlers.has_news(res):
                return False
            if upgrading:
                res["upgrading"] = True
            self.note_stream(f.peer, "output", bool(res["ended"]))
            reply = protocol.ok(f.rid, res)
        self.reply(f.peer, reply)
        return True

    def wake_followers(self, *, force: bool = False) -> None:
        """Answer the parked followers that have news (all of them with ``force``)."""
        self.followers.take_if(None, lambda f: self.answer_follower(f, force=force))
        if not len(self.followers) and self.follow_timer is not None:
            self.follow_timer.cancel()
            self.follow_timer = None

    def add_event_waiter(self, peer: Peer, rid: protocol.RequestId, after: int,
                         hold: float) -> None:
        self.event_waiters.park(None, peer, rid, min(hold, MAX_HOLD), after,
                                self.answer_event_waiter)

    def answer_event_waiter(self, w: Parked[int], *, force: bool = True,
                            upgrading: bool = False) -> bool:
        res = handlers.events_result(self, w.value)
        if not (force or res["events"] or res["ended"]):
            return False
        if upgrading:
            res["upgrading"] = True
        self.note_stream(w.peer, "events", bool(res["ended"]))
        self.reply(w.peer, protocol.ok(w.rid, res))
        return True

    def wake_event_waiters(self, *, force: bool = False) -> None:
        self.event_waiters.take_if(None, lambda w: self.answer_event_waiter(w, force=force))

    def release_waiters(self) -> None:
        self.step_over()
        for p in self.waiters.take(None):
            self.reply(p.peer, protocol.ok(p.rid, {"done": True, "record": self.record}))

    def add_waiter(self, peer: Peer, rid: protocol.RequestId, hold: float) -> None:
        self.waiters.park(None, peer, rid, min(hold, MAX_HOLD), None,
                          lambda p: self.reply(p.peer, protocol.ok(p.rid, {"done": False})))


def private_dir(path: str) -> None:
    """``path`` as a directory only this uid may enter: made if missing, refused if it is a
    link, someone else's, or open to others (its socket would be reachable)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{path} is not a private directory of uid {os.getuid()} "
                      f"(mode {stat.filemode(st.st_mode)}, owner {st.st_uid})")


def reset_signal_dispositions(*, unblock: bool = True) -> None:
    """Undo what the detaching shell left: a background job starts with SIGINT and SIGQUIT
    ignored, and ignored signals survive exec, so tasks would inherit them. Python's own
    SIGPIPE/SIGXFSZ ignores are reset for children by Popen's restore_signals."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ):
            continue
        try:
            if signal.getsignal(sig) == signal.SIG_IGN:
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    if unblock:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _limit_text(seconds: float) -> str:
    """A limit as Slurm prints one, [D-]HH:MM:SS (fractions of a second, from tests, kept)."""
    s = int(seconds)
    text = f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    if s >= 86400:
        text = f"{s // 86400}-{s % 86400 // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return text if seconds == s else f"{seconds:g}s"


def _wake_only(signum: int, frame: object) -> None:
    """The real work happens in the loop, woken through the wakeup fd."""


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
