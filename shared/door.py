"""A door: the one serve loop for people on a plain AF_UNIX socket, shared by the agent and every
supervisor (I/O).

Theory of operation. Every local user may connect, and every one of them is assumed hostile.
ZeroMQ is not used here: a peer could choose its routing id (libzmq aborts the process when its
own counter meets a peer's choice, or hands the peer another's replies), and an accept() that
fails with EMFILE aborts libzmq. On a plain stream socket everything is ours to bound:

- Who: the kernel's credentials of each connection (``SO_PEERCRED``: uid, gid, pid of the process
  that called connect()), never anything in a frame.
- Framing (``framing.py``): each frame's declared size is checked before its body is read; at
  most one frame (plus one 64 KiB read) is buffered per connection; msgpack decodes with limits.
- Caps: connections per uid (and in all), unread reply bytes per connection and per uid,
  partial-frame bytes per uid, requests in flight per connection, and a request rate per uid
  (a token bucket). Hitting a cap never drops what was asked: the door simply stops reading
  from that connection (the kernel's socket buffer holds the rest) until the peer reads its
  replies, its requests are answered or the bucket refills. A connection over the connection
  caps is told so in one error frame (``busy``) and closed.
- Root and the daemon's own uid are not rate-limited and have their own, larger connection cap,
  so no other user can lock them out.
- Logs: a bad frame is logged at most once per connection per second, clipped to 200 bytes.

The daemon's loop polls one fd (``fileno()``: an epoll set holding the listener, every
connection and an eventfd) and calls ``service()`` when it is readable. Work that becomes
possible outside ``service()`` (a reply that frees a connection's budget, a refilled bucket)
is signalled through the eventfd, so the daemon's loop needs no knowledge of any of this.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import select
import socket
import stat
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count

from tether.shared import framing, protocol, zmtp
from tether.shared.errors import Busy, TetherError
from tether.shared.text import clip
from tether.shared.timers import Timer, Timers

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_READ = 1 << 16
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_ERR = select.EPOLLERR | select.EPOLLHUP
#: Lines a second (and a burst) the door logs about bad requests, whoever sends them.
LOG_RATE = 10.0
LOG_BURST = 20.0


@dataclass(frozen=True, slots=True)
class Limits:
    #: connections one uid may hold open (root and the daemon's own uid: ``conns_privileged``)
    conns_per_uid: int = 64
    conns_privileged: int = 256
    conns_total: int = 1024
    #: a connection whose unread replies exceed this is not read from until it reads them
    out_per_conn: int = 1 << 20
    #: the same, summed over one uid's connections
    out_per_uid: int = 8 << 20
    #: partial frames buffered for one uid, summed over its connections
    in_per_uid: int = 4 << 20
    #: requests of one connection not yet answered (long polls included)
    inflight_per_conn: int = 32
    #: requests per second per uid (a token bucket of ``burst``), not for privileged uids
    rate: float = 1000.0
    burst: float = 2000.0


class Conn:
    """One accepted connection; also the ``peer`` handlers see (uid, gid, pid from the kernel)."""

    _serials = count(1)

    def __init__(self, sock: socket.socket, uid: int, gid: int, pid: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.uid, self.gid, self.pid = uid, gid, pid
        self.serial = next(self._serials)
        #: length-prefixed frames, until the first byte says ZMTP (a tether 0.1 client)
        self.deframer: framing.Deframer | zmtp.Codec = framing.Deframer()
        self.fresh = True
        self.out: deque[memoryview] = deque()
        self.out_bytes = 0
        self.inflight = 0
        self.closed = False
        self.closing = False  # answer what is queued, then close (after an unreadable stream)
        self.last_bad_log = -1e9
        self.mask = 0
        #: request id -> the protocol version it spoke, until it is answered
        self.versions: dict[protocol.RequestId, int] = {}

    @property
    def key(self) -> tuple[str, int]:
        return ("door", self.serial)

    def __str__(self) -> str:
        return f"uid {self.uid} pid {self.pid}"

    def __repr__(self) -> str:
        return f"<Conn #{self.serial} {self} out={self.out_bytes} inflight={self.inflight}>"


OnRequest = Callable[[Conn, protocol.Request], None]


class Door:
    def __init__(self, path: str, timers: Timers, on_request: OnRequest, *, name: str,
                 log: logging.Logger, limits: Limits = Limits(),
                 privileged: frozenset[int] | None = None,
                 on_close: Callable[[Conn], None] | None = None,
                 listen_fd: int | None = None) -> None:
        self.path = path
        self.timers = timers
        self.on_request = on_request
        self.on_close = on_close
        self.name = name
        self.log = log
        self.limits = limits
        self.privileged = privileged if privileged is not None else frozenset({0, os.getuid()})
        # A quarter of the open-file limit at most: the daemon's own work needs the rest.
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.conns_total = limits.conns_total if soft == resource.RLIM_INFINITY else min(
            limits.conns_total, max(32, soft // 4))
        self.conns: dict[int, Conn] = {}
        self.by_uid: dict[int, set[Conn]] = {}
        self.out_by_uid: dict[int, int] = {}
        self.in_by_uid: dict[int, int] = {}
        self.buckets: dict[int, tuple[float, float]] = {}  # uid -> (tokens, when)
        self.ready: set[Conn] = set()
        #: connections waiting for their uid's bucket to refill
        self.throttled: set[Conn] = set()
        self.throttle_timer: Timer | None = None
        self.last_refusal_log = -1e9
        self.log_bucket = (LOG_BURST, time.monotonic())
        self.log_dropped = 0
        self.refused = 0
        self.ep = select.epoll()
        self.kick_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.ep.register(self.kick_fd, _IN)
        # a listening socket the caller keeps (across an exec, say) is used through a copy
        self.listener = (_bind(path) if listen_fd is None else
                         socket.socket(fileno=os.dup(listen_fd)))
        self.listener.setblocking(False)
        self.bound_ino = os.stat(path).st_ino
        self.ep.register(self.listener.fileno(), _IN)
        self.closed = False

    def fileno(self) -> int:
        return self.ep.fileno()

    # ---- the loop's entry point ------------------------------------------------------------

    def service(self) -> None:
        """Handle whatever is ready; never blocks."""
        for fd, events in self.ep.poll(0):
            if fd == self.kick_fd:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self.kick_fd)
            elif fd == self.listener.fileno():
                self._accept()
            else:
                conn = self.conns.get(fd)
                if conn is None:
                    continue
                if events & _ERR and not events & _IN:
                    self._drop(conn)  # the peer is gone: nobody left to answer
                    continue
                if events & _OUT:
                    self._flush(conn)
                if events & _IN and not conn.closed:
                    self._read(conn)
        while self.ready:
            conn = self.ready.pop()
            if not conn.closed:
                self._process(conn)
                self._arm(conn)

    def send(self, conn: Conn, reply: protocol.Reply) -> None:
        """Queue the one reply to one of ``conn``'s requests (dropped if it went away)."""
        conn.inflight = max(0, conn.inflight - 1)
        if conn.closed:
            return
        # a reply answers in its request's version (at most ``inflight_per_conn`` remembered)
        v = conn.versions.pop(reply.id, protocol.PROTOCOL_VERSION) if reply.id is not None \
            else protocol.PROTOCOL_VERSION
        data = protocol.encode_reply(reply, v)
        if len(data) > protocol.MAX_FRAME:  # a handler's bug, not the peer's: say so
            self.log.error("%s: reply to %s is %d bytes, over the frame limit", self.name, conn,
                           len(data))
            data = protocol.encode_reply(protocol.error(
                reply.id, TetherError("internal error: reply too large")), v)
        self._queue(conn, conn.deframer.frame(data))
        self._flush(conn)
        if not conn.closed:
            self._arm(conn)
            self._wake_uid(conn.uid)

    def close(self, unlink: bool = True) -> None:
        """Close every connection and the listener; ``unlink`` the path (if it is still the
        socket bound here) unless the caller keeps the listening socket for a successor."""
        if self.closed:
            return
        self.closed = True
        for conn in list(self.conns.values()):
            self._drop(conn)
        self.ep.close()
        os.close(self.kick_fd)
        self.listener.close()
        if not unlink:
            return
        try:  # never unlink a socket someone else bound at our path since
            if os.stat(self.path).st_ino == self.bound_ino:
                os.unlink(self.path)
        except OSError:
            pass

    def stats(self) -> dict[str, int]:
        return {"connections": len(self.conns), "refused": self.refused,
                "queued_bytes": sum(c.out_bytes for c in self.conns.values()),
                "buffered_bytes": sum(c.deframer.buffered for c in self.conns.values())}

    # ---- connections -----------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(64):  # bounded per call: the loop has other work
            try:
                sock, _addr = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._refusal(f"cannot accept: {exc.strerror}; pausing 100 ms")
                    self.ep.modify(self.listener.fileno(), 0)
                    self.timers.at(time.monotonic() + 0.1, self._resume_accept)
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EINTR, errno.EPROTO):
                    continue
                raise
            sock.setblocking(False)
            try:
                pid, uid, gid = _CRED.unpack(sock.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            except OSError:
                sock.close()
                continue
            why = self._over_cap(uid)
            if why is not None:
                self.refused += 1
                self._refusal(f"refused a connection from uid {uid} pid {pid}: {why}")
                with contextlib.suppress(OSError):  # best effort: one line for the client
                    sock.send(framing.frame(protocol.encode_reply(
                        protocol.error(None, Busy(f"{self.name}: {why}; try again later")))))
                sock.close()
                continue
            conn = Conn(sock, uid, gid, pid)
            self.conns[conn.fd] = conn
            self.by_uid.setdefault(uid, set()).add(conn)
            conn.mask = _IN
            self.ep.register(conn.fd, _IN)

    def _resume_accept(self) -> None:
        if not self.closed:
            self.ep.modify(self.listener.fileno(), _IN)

    def _over_cap(self, uid: int) -> str | None:
        held = len(self.by_uid.get(uid, ()))
        if uid in self.privileged:
            if held >= self.limits.conns_privileged:
                return f"uid {uid} holds {held} connections already"
            return None
        if held >= self.limits.conns_per_uid:
            return f"uid {uid} holds {held} connections already (at most " \
                   f"{self.limits.conns_per_uid})"
        if len(self.conns) >= self.conns_total:
            return f"{len(self.conns)} connections open (at most {self.conns_total})"
        return None

    def _drop(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self.conns.pop(conn.fd, None)
        peers = self.by_uid.get(conn.uid)
        if peers is not None:
            peers.discard(conn)
            if not peers:
                del self.by_uid[conn.uid]
        self._account(conn.uid, out=-conn.out_bytes, inn=-conn.deframer.buffered)
        conn.out.clear()
        conn.out_bytes = 0
        with contextlib.suppress(OSError, ValueError):
            self.ep.unregister(conn.fd)
        conn.sock.close()
        self.ready.discard(conn)
        self.throttled.discard(conn)
        if self.on_close is not None:
            self.on_close(conn)
        self._wake_uid(conn.uid)

    def _account(self, uid: int, *, out: int = 0, inn: int = 0) -> None:
        if out:
            left = self.out_by_uid.get(uid, 0) + out
            if left > 0:
                self.out_by_uid[uid] = left
            else:
                self.out_by_uid.pop(uid, None)
        if inn:
            left = self.in_by_uid.get(uid, 0) + inn
            if left > 0:
                self.in_by_uid[uid] = left
            else:
                self.in_by_uid.pop(uid, None)

    # ---- reading ---------------------------------------------------------------------------

    def _may_take(self, conn: Conn) -> bool:
        """May one more request of ``conn`` be taken now (its caps and its uid's)?"""
        lim = self.limits
        return (not conn.closing and conn.inflight < lim.inflight_per_conn
                and conn.out_bytes <= lim.out_per_conn
                and self.out_by_uid.get(conn.uid, 0) <= lim.out_per_uid)

    def _read(self, conn: Conn) -> None:
        if not self._may_take(conn) or conn.deframer.buffered > protocol.MAX_FRAME:
            self._arm(conn)
            return
        try:
            data = conn.sock.recv(_READ)
        except BlockingIOError:
            return
        except OSError:
            self._drop(conn)
            return
        if not data:
            self._drop(conn)
            return
        if conn.fresh:
            conn.fresh = False
            if framing.looks_like_zmtp(data):
                conn.deframer = zmtp.Codec()
        conn.deframer.feed(data)
        self._account(conn.uid, inn=len(data))
        self._process(conn)
        if not conn.closed:
            self._arm(conn)

    def _process(self, conn: Conn) -> None:
        """Take the complete frames buffered for ``conn`` while its caps allow."""
        while not conn.closed and self._may_take(conn):
            try:
                done = conn.deframer.complete()
                handshake = conn.deframer.output()
                if handshake:
                    self._queue(conn, handshake)
                    self._flush(conn)
                if not done:
                    return
            except zmtp.ZmtpError as exc:
                self._bad_log(conn, f"ZMTP: {exc}")
                self._drop(conn)
                return
            except framing.FrameTooLarge as exc:
                conn.inflight += 1
                self._bad(conn, str(exc), None)
                conn.closing = True  # the stream cannot be resynchronised: answer, then close
                self._account(conn.uid, inn=-conn.deframer.buffered)
                conn.deframer = framing.Deframer()
                if not conn.out:
                    self._drop(conn)
                return
            if not self._spend(conn):
                self.throttled.add(conn)  # the refill timer puts it back on the ready list
                self._arm(conn)
                return
            before = conn.deframer.buffered
            payload = conn.deframer.next()
            assert payload is not None
            self._account(conn.uid, inn=conn.deframer.buffered - before)
            conn.inflight += 1
            try:
                req = protocol.decode_request(payload)
            except TetherError as exc:
                rid = getattr(exc, "request_id", None)
                if rid is None:
                    rid = protocol.peek_id(payload)
                self._bad(conn, exc.message, rid, exc)
                continue
            conn.versions[req.id] = req.v
            self.on_request(conn, req)

    def _bad(self, conn: Conn, message: str, rid: protocol.RequestId | None,
             exc: TetherError | None = None) -> None:
        self._bad_log(conn, message)
        err = exc if exc is not None else protocol.DecodeError(message)
        self.send(conn, protocol.error(rid, err))

    def _bad_log(self, conn: Conn, message: str) -> None:
        self.note(conn, f"bad request from {conn}: {clip(message)}")

    def note(self, conn: Conn, line: str) -> None:
        """Log ``line`` about what ``conn`` sent: once per connection per second, and at most
        ~10 lines a second in all (a peer that reconnects for every bad frame gets no more)."""
        now = time.monotonic()
        if now - conn.last_bad_log >= 1.0 and self._log_token(now):
            conn.last_bad_log = now
            self.log.warning("%s: %s", self.name, line if str(conn) in line
                             else f"{line} ({conn})")

    def _log_token(self, now: float) -> bool:
        tokens, when = self.log_bucket
        tokens = min(LOG_BURST, tokens + (now - when) * LOG_RATE)
        if tokens < 1.0:
            self.log_bucket = (tokens, now)
            self.log_dropped += 1
            return False
        if self.log_dropped:
            self.log.warning("%s: %d more bad requests not logged", self.name,
                             self.log_dropped)
            self.log_dropped = 0
        self.log_bucket = (tokens - 1.0, now)
        return True

    def _spend(self, conn: Conn) -> bool:
        """Take one token from the uid's bucket; False (and a refill timer) when empty."""
        if conn.uid in self.privileged:
            return True
        lim = self.limits
        now = time.monotonic()
        tokens, when = self.buckets.get(conn.uid, (lim.burst, now))
        tokens = min(lim.burst, tokens + (now - when) * lim.rate)
        if tokens >= 1.0:
            self.buckets[conn.uid] = (tokens - 1.0, now)
            if len(self.buckets) > 4096:  # forget full buckets of uids long gone
                self.buckets = {u: b for u, b in self.buckets.items() if u in self.by_uid}
            return True
        self.buckets[conn.uid] = (tokens, now)
        if self.throttle_timer is None:
            self.throttle_timer = self.timers.at(now + max(0.01, (1.0 - tokens) / lim.rate),
                                                 self._unthrottle)
        return False

    def _unthrottle(self) -> None:
        self.throttle_timer = None
        waiting, self.throttled = self.throttled, set()
        for conn in waiting:
            if not conn.closed:
                self.ready.add(conn)
        self._kick()

    # ---- writing ---------------------------------------------------------------------------

    def _queue(self, conn: Conn, data: bytes) -> None:
        conn.out.append(memoryview(data))
        conn.out_bytes += len(data)
        self._account(conn.uid, out=len(data))

    def _flush(self, conn: Conn) -> None:
        sent_total = 0
        while conn.out:
            head = conn.out[0]
            try:
                n = conn.sock.send(head)
            except BlockingIOError:
                break
            except OSError:
                self._drop(conn)
                return
            sent_total += n
            if n < len(head):
                conn.out[0] = head[n:]
                break
            conn.out.popleft()
        if sent_total:
            conn.out_bytes -= sent_total
            self._account(conn.uid, out=-sent_total)
            self._wake_uid(conn.uid)
        if conn.closing and not conn.out:
            self._drop(conn)
            return
        self._arm(conn)

    # ---- readiness -------------------------------------------------------------------------

    def _arm(self, conn: Conn) -> None:
        if conn.closed:
            return
        mask = _OUT if conn.out else 0
        if (self._may_take(conn) and conn not in self.throttled
                and self.in_by_uid.get(conn.uid, 0) <= self.limits.in_per_uid):
            if conn.deframer.wanted() > 0 or not conn.deframer.buffered:
                mask |= _IN
            else:  # a whole frame is waiting: take it in service(), without a read
                self.ready.add(conn)
                self._kick()
        if mask != conn.mask:
            conn.mask = mask
            self.ep.modify(conn.fd, mask)

    def _wake_uid(self, uid: int) -> None:
        """A budget of ``uid`` shrank: its paused connections may go on."""
        for conn in self.by_uid.get(uid, ()):
            if not conn.mask & _IN and self._may_take(conn) and conn not in self.throttled:
                self.ready.add(conn)
        if self.ready:
            self._kick()

    def _kick(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_write(self.kick_fd, 1)

    def _refusal(self, message: str) -> None:
        now = time.monotonic()
        if now - self.last_refusal_log >= 1.0:
            self.last_refusal_log = now
            self.log.warning("%s: %s", self.name, message)


def answer(call: Callable[[], object], req: protocol.Request, peer: object,
           reply: Callable[[protocol.Reply], None], log: logging.Logger,
           pending: object, door: Door | None = None) -> None:
    """Run one request's handler and answer it: its result (unless it is ``pending``: a long
    poll answers later), its ``TetherError``, or, for a bug, "internal error" (the traceback
    is logged, never sent). Refusals are logged with the peer, clipped, and for a door's peer
    no more often than its bad requests."""
    try:
        result = call()
    except TetherError as exc:
        if exc.code == "permission_denied":
            line = f"refused {clip(repr(req.kind), 60)}: {clip(exc.message)}"
            if door is not None and isinstance(peer, Conn):
                door.note(peer, line)
            else:
                log.warning("%s from %s", line, peer)
        reply(protocol.error(req.id, exc))
        return
    except Exception:  # a bug must never take the daemon down with it
        log.exception("handler for %s failed", clip(repr(req.kind), 60))
        reply(protocol.error(req.id, TetherError("internal error")))
        return
    if result is not pending:
        reply(protocol.ok(req.id, result))


def listen_socket(path: str) -> int:
    """A door's listening socket at ``path``, as an fd the caller owns (and may keep across
    an exec: ``Door(listen_fd=...)`` works on a copy)."""
    return _bind(path).detach()


def _bind(path: str) -> socket.socket:
    """Listen at ``path`` (mode 0666: every request is authorized on its own). A stale socket
    left by a dead predecessor is replaced; anything else at the path is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK
                         | socket.SOCK_CLOEXEC)
    old = os.umask(0o111)
    try:
        sock.bind(path)
        sock.listen(256)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    return sock
