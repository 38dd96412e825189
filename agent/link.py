"""The agent's link to one supervisor: a ZeroMQ DEALER plus a pidfd (I/O).

Requests are asynchronous: each has an id, a deadline and two callbacks, and the agent's single
loop feeds replies and timeouts in. After a timeout the socket is replaced (and every other
request in flight on it failed), so a request libzmq queued for a dead or hung peer is never
delivered to a successor later, and a late reply is never taken for another's.

One DEALER per supervisor (``LINGER 0``, a flat ``RECONNECT_IVL`` of 10 ms, ``MAXMSGSIZE``:
``zmq_client.configure``), connected to ``ctl/sock``: the ROUTER of a supervisor of this release
and of 0.2.0 to 0.4.0, the ctl door of 0.5.0 and 0.6.0 (which answers ZMTP, shared/zmtp.py), or,
for a supervisor of 0.1.0 (no ``ctl/``), its ROUTER at ``sock`` (``RunDir.agent_sock``). libzmq
connects when the supervisor listens and queues what is sent before: a new supervisor's hello
goes out within 10 ms of its bind. The reply's ``Peer-Address`` holds the kernel's uid and pid
of the process that listens (``SO_PEERCRED``), which follow.py checks against what the
supervisor says in ``hello``.

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
Sock = zmq.Socket[Any]


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
        #: called when the socket is replaced (old, new), so the poller can follow
        self.on_reopen: Callable[[Sock, Sock], None] | None = None
        #: called after each send on the socket (agent/poller.py ``touched``)
        self.on_sent: Callable[[Sock], None] | None = None
        self.sock: Sock = self._open()

    def __repr__(self) -> str:
        return f"<Link job={self.job}.{self.attempt} pending={sorted(self.pending)}>"

    def _open(self) -> Sock:
        sock: Sock = self.ctx.socket(zmq.DEALER)
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
        payload = protocol.encode_request(protocol.Request(id=rid, kind=kind, args=args, v=v))
        timer = self.timers.at(time.monotonic() + timeout, lambda: self._expire(rid, timeout))
        self.pending[rid] = _Pending(kind, on_ok, on_err, timer)
        try:
            # queued by libzmq until the connection exists (a supervisor not listening yet)
            self.sock.send(payload, zmq.NOBLOCK)
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
        """A fresh DEALER in the old one's place: the poller is told first, then the old one is
        closed with linger 0 (what it queued is never delivered)."""
        if self.closed:
            return
        old, self.sock = self.sock, self._open()
        if self.on_reopen is not None:
            self.on_reopen(old, self.sock)
        old.close(linger=0)
        # every other request in flight went out on the old socket: it will never be answered
        # (a callback may drop the link, which forgets the rest: ``close``)
        for rid in list(self.pending):
            pend = self.pending.pop(rid, None)
            if pend is None:
                continue
            pend.timer.cancel()
            pend.on_err(Unreachable(f"connection to {self.path} was reset"))

    def readable(self) -> None:
        """Every reply waiting (until ``Again``: the socket's fd is edge-like, poller.py)."""
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
            self._deliver(frame.bytes)

    def _deliver(self, payload: bytes) -> None:
        try:
            reply = protocol.decode_reply(payload)
        except BadRequest as exc:
            log.warning("job %d: undecodable reply from its supervisor: %s", self.job, exc)
            return
        if reply.id is None and not reply.ok:
            # The peer could not read some frame of ours: we cannot tell which request, so
            # every one in flight gets the error (the protocol's rule for id-less errors).
            log.warning("job %d: supervisor could not decode a request: %s", self.job,
                        reply.message)
            for rid in list(self.pending):
                stale = self.pending.pop(rid, None)
                if stale is None:  # a callback dropped the link (``close``)
                    continue
                stale.timer.cancel()
                stale.on_err(RemoteError(reply.code, reply.message))
            return
        pend = self.pending.pop(reply.id, None) if isinstance(reply.id, int) else None
        if pend is None:
            log.debug("job %d: reply to unknown request %r dropped", self.job, reply.id)
            return
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
        """Closes the socket and the pidfd: the caller unregistered both first."""
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
