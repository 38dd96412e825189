"""The agent's connection to one supervisor: a DEALER socket plus a pidfd (I/O).

Requests are asynchronous: each has an id, a deadline and two callbacks, and the agent's single
loop feeds replies and timeouts in. After a timeout the socket is replaced, so a request libzmq
queued for a dead or hung peer is never delivered to a successor later.

The pidfd tells the loop the moment the supervisor process ends, without polling and without
pid-reuse races: it is opened once the supervisor's (pid, start ticks) are confirmed, and the
identity is checked again right after opening.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from tether.shared import protocol
from tether.shared.errors import BadRequest, RemoteError, TetherError, Unreachable
from tether.shared.procid import ProcId
from tether.shared.timers import Timer, Timers
from tether.shared.zmq_client import configure

log = logging.getLogger("tether.agent")

OnOk = Callable[[Any], None]
OnErr = Callable[[TetherError], None]


@dataclass
class _Pending:
    kind: str
    on_ok: OnOk
    on_err: OnErr
    timer: Timer


class Link:
    _ids = itertools.count(1)

    def __init__(self, ctx: zmq.Context[Any], timers: Timers, job: int, attempt: int,
                 path: str) -> None:
        self.ctx = ctx
        self.timers = timers
        self.job = job
        self.attempt = attempt
        self.path = path
        self.pending: dict[int, _Pending] = {}
        self.sock = self._open()
        self.pidfd: int | None = None
        self.ident: ProcId | None = None
        self.closed = False
        #: the kernel's pid and uid of the process that answered last (Peer-Address), -1 if
        #: unknown: taken from SO_PEERCRED, so a process cannot lie about them
        self.peer_pid = -1
        self.peer_uid = -1
        #: the protocol version negotiated by ``hello`` (None before): every later request on
        #: this link is sent in it, so a supervisor of the release before is driven in its own
        #: version; the release it answered with, for messages
        self.protocol: int | None = None
        self.release = "?"
        #: called when the socket is replaced, so the poller can follow
        self.on_reopen: Callable[[zmq.Socket[Any], zmq.Socket[Any]], None] | None = None
        #: called after each send on the socket (agent/poller.py ``touched``)
        self.on_sent: Callable[[zmq.Socket[Any]], None] | None = None

    def __repr__(self) -> str:
        return f"<Link job={self.job}.{self.attempt} pending={sorted(self.pending)}>"

    def _open(self) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self.ctx.socket(zmq.DEALER)
        configure(sock)
        sock.connect("ipc://" + self.path)
        return sock

    @property
    def target(self) -> dict[str, int]:
        return {"job": self.job, "attempt": self.attempt}

    def request(self, kind: str, args: dict[str, Any], timeout: float, on_ok: OnOk,
                on_err: OnErr) -> None:
        try:
            v = protocol.version_for(kind, self.protocol)
        except TetherError as exc:  # this supervisor's release does not have the kind
            on_err(type(exc)(f"the supervisor of job {self.job}.{self.attempt} is "
                             f"{self.release}: {exc.message}"))
            return
        rid = next(self._ids)
        frame = protocol.encode_request(protocol.Request(id=rid, kind=kind, args=args, v=v))
        timer = self.timers.at(time.monotonic() + timeout, lambda: self._expire(rid, timeout))
        self.pending[rid] = _Pending(kind, on_ok, on_err, timer)
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            del self.pending[rid]
            timer.cancel()
            on_err(Unreachable(f"cannot send {kind!r} to {self.path}: {exc}"))
            return
        if self.on_sent is not None:
            self.on_sent(self.sock)

    def _expire(self, rid: int, timeout: float) -> None:
        pend = self.pending.pop(rid, None)
        if pend is None:
            return
        self._reopen()
        pend.on_err(Unreachable(
            f"supervisor of job {self.job}.{self.attempt} did not answer {pend.kind!r} within "
            f"{timeout:g}s"))

    def _reopen(self) -> None:
        if self.closed:
            return
        old = self.sock
        self.sock = self._open()
        old.close(linger=0)
        if self.on_reopen:
            self.on_reopen(old, self.sock)
        # every other request in flight went out on the old socket: it will never be answered
        for rid in list(self.pending):
            pend = self.pending.pop(rid)
            pend.timer.cancel()
            pend.on_err(Unreachable(f"connection to {self.path} was reset"))

    def readable(self) -> None:
        while not self.closed:
            try:
                frame = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                _, uid, _, pid = str(frame.get("Peer-Address")).rsplit(":", 3)
                self.peer_uid, self.peer_pid = int(uid), int(pid)
            except (zmq.ZMQError, ValueError):
                self.peer_uid = self.peer_pid = -1
            try:
                reply = protocol.decode_reply(frame.bytes)
            except BadRequest as exc:
                log.warning("job %d: undecodable reply from its supervisor: %s", self.job, exc)
                continue
            if reply.id is None and not reply.ok:
                # The peer could not read some frame of ours: we cannot tell which, so every
                # request in flight gets the error (the protocol's rule for id-less errors).
                log.warning("job %d: supervisor could not decode a request: %s", self.job,
                            reply.message)
                for rid in list(self.pending):
                    stale = self.pending.pop(rid)
                    stale.timer.cancel()
                    stale.on_err(RemoteError(reply.code, reply.message))
                continue
            pend = self.pending.pop(reply.id, None) if isinstance(reply.id, int) else None
            if pend is None:
                log.debug("job %d: reply to unknown request %r dropped", self.job, reply.id)
                continue
            pend.timer.cancel()
            if reply.ok:
                pend.on_ok(reply.result)
            else:
                pend.on_err(RemoteError(reply.code, reply.message))

    def watch(self, ident: ProcId) -> bool:
        """Open a pidfd on the supervisor; False if that very process is already gone."""
        if self.pidfd is not None:
            return True
        try:
            fd = os.pidfd_open(ident.pid)
        except (ProcessLookupError, OSError):
            return False
        if not ident.alive():  # the pid may have been reused between our check and the open
            os.close(fd)
            return False
        self.pidfd = fd
        self.ident = ident
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for pend in self.pending.values():
            pend.timer.cancel()
        self.pending.clear()
        self.sock.close(linger=0)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
