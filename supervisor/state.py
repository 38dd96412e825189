"""The supervisor's state, shared by the parts of ``service.Supervisor``.

The supervisor is one object on one loop, but its code is split by what it does: the loop
(service.py), requests (requests.py), what the step machine decides (machine.py, pure) and its
effects carried out (effects.py), the launch (claims.py), ending a step (terminating.py,
reaping.py), PMI (pmi_loop.py), records (recording.py), long polls (follow.py) and re-executing
(reexec.py). Each part is a mixin of ``SupervisorState``, which holds every attribute (one
``__init__``, so the whole state is read in one place) and declares, for the type checker only,
the methods one part calls in another, so that each part type-checks on its own: at run time
each method exists once, in its part. Request handlers read this state as their view
(handlers.py) and never call into the parts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tether.shared import faults, protocol
from tether.shared.door import Door
from tether.shared.door_conn import Conn
from tether.shared.parking import Lot, Parked
from tether.shared.paths import RunDir
from tether.shared.procid import ProcId
from tether.shared.step_cgroup import StepCgroup
from tether.shared.timers import Timer, Timers
from tether.supervisor import introspect, machine
from tether.supervisor.ctl import Ctl, CtlPeer
from tether.supervisor.launch import Launcher
from tether.supervisor.machine_events import Event
from tether.supervisor.opener import LaunchFailed, Opened, Opener, ThreadOpener
from tether.supervisor.pmi import DEFAULT_MAX_STORE_BYTES, Output, PmiServer
from tether.supervisor.pmi_io import PmiChannels, clean_env
from tether.supervisor.step import Step
from tether.supervisor.sweeper import HOLD, HOLD_SCAN, PROC_SCAN, Scan, Sweeper, children_files

log = logging.getLogger("tether.supervisor")

TERMINATING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
IGNORED_SIGNALS = (signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

#: who sent a request: the agent on the ctl ROUTER (ctl.py) or a connection to the door
#: (anyone); its uid, gid and pid are the kernel's (SO_PEERCRED)
Peer = Conn | CtlPeer
#: Returned by a handler (handlers.py) that will answer later: a long poll, a /proc scan.
PENDING = object()
#: computes a reply from a /proc scan's processes (``after_scan``)
ScanReply = Callable[[list[introspect.ProcSample]], Any]


@dataclass(frozen=True)
class Follow:
    """What a parked ``output`` follow request wants."""

    streams: tuple[str, ...]
    offsets: dict[str, int]


class SupervisorState:
    """Every attribute of a supervisor, and the methods its parts call in one another."""

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
                                 kvsname=f"tether-{rd.job}.{rd.attempt}",
                                 max_store_bytes=int(spec.get("pmi_store_bytes",
                                                              DEFAULT_MAX_STORE_BYTES)))
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
        #: the loop's poller over plain fds (``select.poll``: a handful of them, none of ZeroMQ's)
        self.poller = select.poll()
        #: rank -> our end and its fd, as registered (the fd: the channel may have closed the
        #: socket by the time it is unregistered, and the poller knows fds only)
        self.pmi_socks: dict[int, tuple[socket.socket, int]] = {}
        self.timers = Timers()
        self.ident = ProcId.of(os.getpid())
        self.session = os.getsid(0)
        #: parked ``wait`` (the agent), ``output`` follows and ``events`` (value: ``after``)
        self.waiters: Lot[None, None] = Lot(self.timers)
        #: ``claim`` requests waiting for the opener and the launch
        self.claims: Lot[None, None] = Lot(self.timers)
        self.opener: Opener | ThreadOpener | None = None
        self.opener_timer: Timer | None = None
        self.followers: Lot[None, Follow] = Lot(self.timers)
        self.event_waiters: Lot[None, int] = Lot(self.timers)
        self.record: dict[str, Any] | None = None
        #: the step's state and what it decides (machine.py); effects.py carries it out and
        #: writes its phase and flags into ``step``
        self.machine = machine.start()
        #: the machine's timers by name (machine_effects.TIMERS): claim, ready, kill, limit,
        #: drain, linger, record, ack
        self.machine_timers: dict[str, Timer] = {}
        #: what the output opener handed back, until the launch takes it
        self.opened_files: Opened | LaunchFailed | None = None
        self.running = True
        self.remove_rundir = False
        self.drain_check: Timer | None = None
        #: a cluster step's lease (fencing.py): its file, the timeout, the last renewal seen
        #: (CLOCK_BOOTTIME), when watching began, and the next look
        self.fence_path: str | None = None
        self.fence_after = 0.0
        self.lease_since: float | None = None
        self.fence_started = 0.0
        self.fence_timer: Timer | None = None
        #: finds leftover children while draining: from the children files, else off the loop
        #: (sweeper.py)
        self.sweeper = Sweeper(rd.path if faults.supervisor_fault(HOLD) else None,
                               inline=children_files() and not faults.supervisor_fault(PROC_SCAN))
        #: children found by the last scan, killed and not yet reaped
        self.leftovers = 0
        me, session = os.getpid(), os.getsid(0)
        #: the /proc scans behind ``pids`` and ``stats``, off the loop; ``scan_seq`` numbers
        #: them (the one running or last started), and requests wait under the one they need
        full = faults.supervisor_fault(PROC_SCAN)
        self.scans = Scan(lambda: introspect.step_snapshot(me, session, full=full),
                          (rd.path, "scan") if faults.supervisor_fault(HOLD_SCAN) else None)
        self.scan_seq = 0
        self.scan_waiters: Lot[int, ScanReply] = Lot(self.timers)
        #: the agent's endpoint: a ROUTER on ``ctl/sock`` (a 0700 directory, ctl.py), on the
        #: listening socket ``listen_fd``; a door on ``sock`` for an image resumed from format 1
        self.ctl: Ctl | Door | None = None
        #: everyone's door: ``sock``, the listening socket ``door_fd``
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
        #: the release the installed build said it is, when an upgrade was asked for
        self.upgrade_target: str | None = None
        #: the release this process ran before its last re-exec, if any
        self.upgraded_from: str | None = None
        self.resumed = False

    # ---- implemented by the parts (see the module's docstring) ---------------------------
    # Declared for the type checker only: at run time each method exists once, in its part.

    if TYPE_CHECKING:
        # claims.py
        def answer_claims(self) -> None: ...
        def discard_files(self) -> None: ...
        def drop_opener(self) -> None: ...
        def fork(self) -> None: ...
        def kill_cgroup(self) -> None: ...
        def start_opener(self, *, fork: bool = False) -> None: ...

        # effects.py
        def arm(self, name: str, when: float) -> None: ...
        def feed(self, event: Event) -> None: ...

        # fencing.py
        def start_fencing(self) -> None: ...

        # follow.py
        def add_event_waiter(self, peer: Peer, rid: protocol.RequestId, after: int,
                             hold: float) -> None: ...
        def add_follower(self, peer: Peer, rid: protocol.RequestId, streams: tuple[str, ...],
                         offsets: dict[str, int], hold: float) -> None: ...
        def add_waiter(self, peer: Peer, rid: protocol.RequestId, hold: float) -> None: ...
        def answer_event_waiter(self, w: Parked[int], *, force: bool = True,
                                upgrading: bool = False) -> bool: ...
        def answer_follower(self, f: Parked[Follow], *, force: bool = True,
                            upgrading: bool = False) -> bool: ...
        def note_stream(self, peer: Peer, verb: str, ended: bool) -> None: ...
        def release_waiters(self) -> None: ...
        def streams_active(self) -> bool: ...
        def wake_event_waiters(self, *, force: bool = False) -> None: ...
        def wake_followers(self, *, force: bool = False) -> None: ...

        # pmi_loop.py
        def handle_pmi(self, outputs: list[Output]) -> None: ...
        def kill_ranks(self, why: str) -> None: ...
        def note_pmi_unused(self) -> None: ...
        def sync_pmi_registrations(self) -> None: ...

        # reaping.py
        def announce_end(self) -> None: ...
        def measure_end(self) -> None: ...
        def reap(self) -> None: ...

        # recording.py
        def build_record(self) -> dict[str, Any]: ...
        def emit(self, kind: str, **fields: Any) -> None: ...
        def ready_manifest(self) -> None: ...
        def step_over(self) -> None: ...
        def write_manifest(self, *, launching: bool = False) -> bool: ...
        def write_record_file(self) -> bool: ...

        # reexec.py
        def request_upgrade(self) -> str: ...

        # requests.py
        def after_scan(self, peer: Peer, rid: protocol.RequestId, compute: ScanReply) -> None: ...
        def on_door_close(self, conn: Conn) -> None: ...
        def on_door_request(self, conn: Conn, req: protocol.Request) -> None: ...
        def handle(self, peer: Peer, req: protocol.Request) -> None: ...
        def reply(self, peer: Peer, reply: protocol.Reply) -> None: ...

        # terminating.py
        def suspension_owed(self) -> float: ...


def killpg(pgid: int, sig: int) -> None:
    """Signal a process group that may be gone already (or, after setuid, not ours)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
