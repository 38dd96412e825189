"""The agent's connection to one supervisor: a native connection (or, for a supervisor of 0.1.0
to 0.4.0, a ZeroMQ DEALER) plus a pidfd (I/O).

Requests are asynchronous: each has an id, a deadline and two callbacks, and the agent's single
loop feeds replies and timeouts in. After a timeout the connection is dropped, so a request
queued for a dead or hung peer is never delivered to a successor later.

Native first (agent/link_conn.py: frames over a plain AF_UNIX socket, what a 0.5.0 supervisor's
door speaks), the DEALER only for a peer that shows it serves ZeroMQ: its first bytes are a ZMTP
greeting, or it closes a fresh connection without a word (a libzmq ROUTER that reads our frame
before it sends its greeting drops the connection at once). Then a second connection listens
before it speaks (``PROBE``): a greeting means ZeroMQ, and every request in flight goes again on
a DEALER (the ROUTER refused our frames at its handshake: none reached the supervisor); silence
means a door, which never speaks first. The DEALER also speaks to doors (ZMTP, which a door
answers), so a link that went to it stays correct whatever later serves the path.

What the native connection keeps of the DEALER's behaviour: a connect that finds nobody
listening is tried again every ``RETRY`` seconds while a request waits to go out (libzmq's flat
reconnect interval, ``zmq_client.configure``); a connection that dies leaves the requests sent
on it to their deadlines (the pidfd, or the timeout, decides), and the requests not yet written
go out on the next one.

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

from tether.agent.link_conn import Conn, Zmtp
from tether.shared import framing, protocol
from tether.shared.errors import BadRequest, RemoteError, TetherError, Unreachable
from tether.shared.procid import ProcId
from tether.shared.timers import Timer, Timers
from tether.shared.zmq_client import configure

log = logging.getLogger("tether.agent")

OnOk = Callable[[Any], None]
OnErr = Callable[[TetherError], None]
#: seconds between connects while nobody listens and a request waits (libzmq's, before)
RETRY = 0.01
#: how long a connection opened after a wordless close listens before it speaks
PROBE = 0.2


@dataclass
class _Pending:
    kind: str
    on_ok: OnOk
    on_err: OnErr
    timer: Timer
    payload: bytes


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
        #: the kernel's pid and uid of the process that answered last (SO_PEERCRED, or the
        #: DEALER's Peer-Address), -1 if unknown: a process cannot lie about them
        self.peer_pid = -1
        self.peer_uid = -1
        #: the protocol version negotiated by ``hello`` (None before): every later request on
        #: this link is sent in it, so a supervisor of the release before is driven in its own
        #: version; the release it answered with, for messages
        self.protocol: int | None = None
        self.release = "?"
        #: the peer serves ZeroMQ (before 0.5.0): every request goes through a DEALER
        self.legacy = False
        #: native: (request id, frame) not handed to a connection yet (none open, or it
        #: listens first); a request no longer waited for is never sent
        self.queue: list[tuple[int, bytes]] = []
        self.retry: Timer | None = None
        #: the open connection listens before it speaks until this fires (see the docstring)
        self.probe: Timer | None = None
        #: called when the socket is replaced (either may be None: no connection), so the
        #: poller can follow
        self.on_reopen: Callable[[Any, Any], None] | None = None
        #: called after each send on a ZeroMQ socket (agent/poller.py ``touched``)
        self.on_sent: Callable[[zmq.Socket[Any]], None] | None = None
        #: called with a native connection and whether it has bytes its buffer did not take
        #: (agent/poller.py ``want_write``)
        self.on_write: Callable[[Conn, bool], None] | None = None
        self.sock: Conn | zmq.Socket[Any] | None = None
        try:
            self.sock = self._connect()
        except OSError:
            pass  # nobody listens yet: the first request tries again

    def __repr__(self) -> str:
        return f"<Link job={self.job}.{self.attempt} pending={sorted(self.pending)}>"

    def _connect(self) -> Conn:
        conn = Conn.open(self.path)
        self.peer_pid, self.peer_uid = conn.peer_pid, conn.peer_uid
        return conn

    def _dealer(self) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self.ctx.socket(zmq.DEALER)
        configure(sock)
        sock.connect("ipc://" + self.path)
        return sock

    def _replace(self, new: Conn | zmq.Socket[Any] | None) -> None:
        """Put ``new`` in the old socket's place: the poller is told first, then the old one
        is closed (its fd number must not be reused while the poller still watches it)."""
        old, self.sock = self.sock, new
        if self.on_reopen is not None and (old is not None or new is not None):
            self.on_reopen(old, new)
        if isinstance(old, Conn):
            old.close()
        elif old is not None:
            old.close(linger=0)

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
        self.pending[rid] = _Pending(kind, on_ok, on_err, timer, payload)
        if self.legacy:
            self._send_zmq(rid, payload)
            return
        self.queue.append((rid, framing.frame(payload)))
        self._pump()

    def _send_zmq(self, rid: int, payload: bytes) -> None:
        assert isinstance(self.sock, zmq.Socket)
        try:
            self.sock.send(payload, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            pend = self.pending.pop(rid)
            pend.timer.cancel()
            pend.on_err(Unreachable(f"cannot send {pend.kind!r} to {self.path}: {exc}"))
            return
        if self.on_sent is not None:
            self.on_sent(self.sock)

    # ---- the native connection ----------------------------------------------------------

    def _pump(self) -> None:
        """Hand the queued frames to the connection (opening one if none is open and no
        retry is due) and write what its buffer takes."""
        if self.closed or self.legacy:
            return
        self.queue = [item for item in self.queue if item[0] in self.pending]
        if self.sock is None:
            if self.retry is not None or not self.queue:
                return
            try:
                new = self._connect()
            except OSError:
                self.retry = self.timers.at(time.monotonic() + RETRY, self._retry)
                return
            self._replace(new)
        conn = self.sock
        assert isinstance(conn, Conn)
        if self.probe is None and self.queue:
            conn.out.extend(self.queue)
            self.queue.clear()
        try:
            conn.flush()
        except OSError:
            self._dead(conn)
            return
        if self.on_write is not None:
            self.on_write(conn, conn.wants_write)

    def _retry(self) -> None:
        self.retry = None
        self._pump()

    def _stop(self, *, retry: bool = False) -> None:
        """Cancel the listen-first window (and the connect retry, with ``retry``)."""
        if self.probe is not None:
            self.probe.cancel()
            self.probe = None
        if retry and self.retry is not None:
            self.retry.cancel()
            self.retry = None

    def _dead(self, conn: Conn) -> None:
        """The connection closed or failed: requests sent on it wait for their deadlines;
        those not written yet go out on the next one. A fresh connection closed without a
        word while requests waited may mean a libzmq ROUTER: the next one listens first."""
        if conn is not self.sock:
            return  # replaced already: what it held was dealt with then
        self.queue[:0] = conn.frames_unsent()
        suspect = not conn.heard and bool(self.pending)
        self._replace(None)
        self._stop()
        if not suspect:
            self._pump()
            return
        try:
            new = self._connect()
        except OSError:
            self._pump()  # gone, or not listening: retried while something waits
            return
        self._replace(new)
        self.probe = self.timers.at(time.monotonic() + PROBE, self._probed)

    def _probed(self) -> None:
        """The listening connection heard nothing: a door (which never speaks first)."""
        self.probe = None
        self._pump()

    def _to_legacy(self) -> None:
        """The peer greeted in ZMTP: from now on a DEALER, and every request in flight goes
        again on it (the ROUTER's handshake refused our frames: none reached the supervisor)."""
        log.info("job %d: its supervisor serves ZeroMQ (before 0.5.0): talking to it through a "
                 "DEALER", self.job)
        self.legacy = True
        self.queue.clear()
        self._stop(retry=True)
        self._replace(self._dealer())
        for rid in list(self.pending):
            if rid in self.pending:
                self._send_zmq(rid, self.pending[rid].payload)

    def _read_native(self, conn: Conn) -> None:
        try:
            conn.flush()
        except OSError:
            pass  # the receive below finds the connection's end
        try:
            frames, eof = conn.receive()
        except Zmtp:
            self._to_legacy()
            return
        except framing.FrameTooLarge as exc:
            log.warning("job %d: its supervisor sent a bad frame (%s): reconnecting",
                        self.job, exc)
            frames, eof = [], True
            conn.heard = True
        except OSError as exc:
            log.warning("job %d: reading from its supervisor: %s", self.job, exc)
            frames, eof = [], True
        spoke = self.probe is not None and conn.heard
        if spoke:
            self._stop()  # it spoke first, and not in ZMTP: a door (a refusal, say)
        # what it said first (a refusal fails what waits), then its end, then what waited to
        # go out: never onto a connection that is already gone
        for payload in frames:
            self._deliver(payload)
            if self.closed or self.sock is not conn:
                return
        if eof:
            self._dead(conn)
        elif spoke:
            self._pump()
        elif self.on_write is not None:
            self.on_write(conn, conn.wants_write)

    # ---- replies ------------------------------------------------------------------------

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
        if self.legacy:
            self._replace(self._dealer())
        else:  # the next request connects afresh
            self.queue.clear()
            self._stop()
            self._replace(None)
        # every other request in flight went out on the old socket: it will never be answered
        # (a callback may drop the link, which forgets the rest: ``close``)
        for rid in list(self.pending):
            pend = self.pending.pop(rid, None)
            if pend is None:
                continue
            pend.timer.cancel()
            pend.on_err(Unreachable(f"connection to {self.path} was reset"))

    def readable(self) -> None:
        if isinstance(self.sock, Conn):
            self._read_native(self.sock)
            return
        while not self.closed and isinstance(self.sock, zmq.Socket):
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
            # The peer could not read some frame of ours (or refused the connection): we
            # cannot tell which request, so every one in flight gets the error (the
            # protocol's rule for id-less errors).
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
        self._stop(retry=True)
        self.queue.clear()
        sock, self.sock = self.sock, None
        if isinstance(sock, Conn):
            sock.close()
        elif sock is not None:
            sock.close(linger=0)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
