"""Re-executing the supervisor into the installed release (``upgrade``), and resuming after it.

``request_upgrade`` checks that the installed build starts; the loop then calls ``reexec``, which
answers everything parked, hands the state across exec (handover.py) and execs; a failed exec
carries on as before. The new image calls ``restore`` with that state before its loop starts.
The listening sockets (the ctl ROUTER's and the door's) stay open across the exec. A mixin of
``service.Supervisor``; its state is ``state.py``'s.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import sys
from typing import Any

import tether
from tether.shared import protocol
from tether.shared.door import Door
from tether.shared.errors import StateError
from tether.supervisor import handover, machine
from tether.supervisor.ctl import Ctl
from tether.supervisor.machine_events import LaunchNotRecorded
from tether.supervisor.pmi_io import PmiChannels
from tether.supervisor.state import IGNORED_SIGNALS, TERMINATING, SupervisorState
from tether.supervisor.step import Phase

log = logging.getLogger("tether.supervisor")


class Reexec(SupervisorState):
    """Re-executing into the installed release, and resuming from the previous image."""

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
        for name in ("claim", "kill", "limit"):
            if name in timers:
                self.arm(name, float(timers[name]))
        if state["machine"] is not None:
            self.machine = state["machine"]
        else:  # an image of 0.6.0 or before had no machine: it is read off the step
            self.machine = machine.resume(
                self.step.phase, cancelled=self.step.cancelled, timed_out=self.step.timed_out,
                terminated_by=self.step.terminated_by, durable=False,
                terminating="kill" in timers)
        if self.step.phase is Phase.RUNNING:
            self.start_fencing()  # the lease is read again from the file: nothing to hand over

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

    def open_doors(self) -> None:
        """The agent's endpoint and everyone's door on their kept listening sockets, polled.
        The agent's is a ZeroMQ ROUTER in ctl/ (ctl.py; its context made now, in this
        process); for an image resumed from before the doors (no ``door_fd``: handover format
        1) a door at ``sock``, where that image listened, open to every user: a door is built
        for that, a ROUTER is not (docs/security.md), and the agent's DEALER speaks ZMTP to
        it, which a door answers (zmtp.py)."""
        if self.door_fd >= 0:
            self.ctl = Ctl(self.rd.ctl_sock, self.listen_fd, self.handle)
            self.poller.register(self.ctl.fileno(), select.POLLIN)
            self.door = self._door(self.rd.sock, self.door_fd, "supervisor door")
            self.poller.register(self.door.fileno(), select.POLLIN)
        else:
            self.ctl = self._door(self.rd.sock, self.listen_fd, "supervisor ctl")
            self.poller.register(self.ctl.fileno(), select.POLLIN)

    def close_doors(self, *, unlink: bool) -> None:
        """Every connection closed, the ROUTER's last replies delivered (ctl.py); the
        listening sockets stay open: ours for life, and across an exec for the next image.
        ``unlink`` their paths (if still theirs) unless that image is to listen there."""
        for door in (self.ctl, self.door):
            if door is not None:
                self.poller.unregister(door.fileno())
                door.close(unlink=unlink)
        self.ctl = self.door = None

    def _door(self, path: str, listen_fd: int, name: str) -> Door:
        return Door(path, self.timers, self.on_door_request, name=name, log=log,
                    on_close=self.on_door_close, listen_fd=listen_fd,
                    privileged=frozenset({0, os.getuid(), int(self.spec["agent_uid"])}))

    def reexec(self) -> None:
        """Answer everything parked, hand the state over and exec. Returns only on failure."""
        for p in self.waiters.take(None):
            self.reply(p.peer, protocol.ok(p.rid, {"done": False, "upgrading": True}))
        for f in self.followers.take(None):
            self.answer_follower(f, upgrading=True)
        for w in self.event_waiters.take(None):
            self.answer_event_waiter(w, upgrading=True)
        if self.machine.state is machine.State.CLAIMED:  # still opening files: claim again
            self.feed(LaunchNotRecorded(reason="upgrading; claim again"))
        state = handover.capture(self)
        state_fd = handover.write_state(state)
        keep = handover.kept_fds(state, self.lock_fd)
        blocked = {signal.SIGCHLD, *TERMINATING, *IGNORED_SIGNALS}
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        self.close_doors(unlink=False)  # the replies above have been written
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
        self.open_doors()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
