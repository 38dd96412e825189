"""The PMI server (pmi.py, pure) wired into the supervisor's loop.

The ranks' PMI sockets (pmi_io.py) are registered with the loop's poller, read and written as they
become ready; what the server answers is acted on here: bytes to send, and an abort, a protocol
error or a broken collective, each of which fails the step and kills its ranks. A mixin of
``service.Supervisor``; its state is ``state.py``'s.
"""

from __future__ import annotations

import logging
import os
import select
import signal
from typing import Any

from tether.supervisor.pmi import Abort, Broken, Finalized, Output, ProtocolError, Send
from tether.supervisor.state import SupervisorState, killpg

log = logging.getLogger("tether.supervisor")

_READABLE = select.POLLIN | select.POLLHUP | select.POLLERR


class PmiLoop(SupervisorState):
    """The PMI server's sockets on the loop, and what its outputs mean for the step."""

    def pmi_events(self, events: dict[Any, int]) -> None:
        assert self.channels is not None
        ours = [(fd, rank) for fd, rank in self.channels.fd_ranks().items() if fd in events]
        for fd, rank in ours:
            flags = events[fd]
            if flags & _READABLE:  # a hang-up or an error too: the read sees EOF or the error
                self.handle_pmi(self.channels.readable(rank))
            if flags & select.POLLOUT:
                self.channels.flush(rank)
        if ours:
            self.sync_pmi_registrations()

    def sync_pmi_registrations(self) -> None:
        """Keep the poller's view of the PMI fds in step with the channels."""
        if self.channels is None:
            return
        want_write = self.channels.wants_write()
        for rank, (sock, fd) in list(self.pmi_socks.items()):
            if self.channels.ours.get(rank) is not sock:
                self.poller.unregister(fd)  # before any socket registered below reuses it
                del self.pmi_socks[rank]
        for rank, sock in self.channels.ours.items():
            flags = select.POLLIN | (select.POLLOUT if rank in want_write else 0)
            if rank in self.pmi_socks:
                self.poller.modify(sock, flags)
            else:
                self.poller.register(sock, flags)
                self.pmi_socks[rank] = (sock, sock.fileno())

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

    def note_pmi_unused(self) -> None:
        """At the step's end: a PMI step none of whose ranks sent its PMI fd a byte (an MPI
        without a PMI-1/PMI-2 client, Debian's Open MPI say: each rank ran alone, as rank 0 of
        1) ends as if all were well. Say so where its user looks first, rank 0's error file,
        and in the log and the exit record (``pmi_unused``: ``show`` says pmi unused). Not for
        a step whose launch failed or that was cancelled."""
        if (self.pmi is None or self.pmi.spoken() or self.step.cancelled
                or not all(t.pid for t in self.step.tasks)):
            return
        self.step.pmi_unused = True
        log.warning("no rank spoke PMI: each ran alone (an MPI without PMI-1/PMI-2?)")
        reader = self.launcher.readers.get("stderr")
        if reader is None:  # its user may not read it: neither may we write it
            return
        note = (f"tether: warning: job {self.rd.job} asked for PMI ({self.spec.get('pmi')}), "
                "but none of its ranks spoke PMI on PMI_FD: each ran alone, as rank 0 of 1. "
                "Its MPI needs a PMI-1 or PMI-2 client (MPICH, Intel MPI, MVAPICH; not "
                "Debian's Open MPI, which speaks PMIx only): see docs/pmi.md\n")
        try:
            # the file the job's user opened (through its read-only fd: no path is followed),
            # appended to like the tasks' own writes
            fd = os.open(f"/proc/self/fd/{reader}", os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            try:
                os.write(fd, note.encode())
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("cannot write the PMI warning to the error file: %s", exc)

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
                killpg(task.pid, signal.SIGKILL)
