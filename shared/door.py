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
- Caps (``door_caps.py``), per person (a uid with its subordinate uids: ``persons``, which
  the agent gives from /etc/subuid): connections, unread reply bytes (and per connection),
  partial-frame bytes, requests in flight (and per connection), and a request rate (a token
  bucket). Hitting a person's cap never drops what was asked: the door simply stops reading
  from that connection (the kernel's socket buffer holds the rest) until the peer reads its
  replies, its requests are answered or the bucket refills. Over its partial-frame cap a
  person's connections pause but for the one holding the most of a frame, which is read on to
  its end; once that frame is taken the others go on: only that person waits, and never for
  good. A connection over its person's connection cap is told so in one error frame (``busy``)
  and closed.
- Totals, shared fairly: connections, partial frames, unread replies and requests in flight of
  everyone but the privileged. When one is reached the person holding the most yields: its
  oldest idle (else newest) connection, or its connection holding the most of what is short,
  gets one ``busy`` frame and is closed (``_make_room``, ``_evict``); the newcomer is refused
  only when its own person holds as many connections (but one).
- Root and the daemon's own uid are not rate-limited and have their own, larger connection cap,
  so no other user can lock them out.
- Logs: a bad frame is logged at most once per connection per second, clipped to 200 bytes.

The daemon's loop polls one fd (``fileno()``: an epoll set holding the listener, every
connection and an eventfd) and calls ``service()`` when it is readable. Work that becomes
possible outside ``service()`` (a reply that frees a connection's budget, a refilled bucket)
is signalled through the eventfd, so the daemon's loop needs no knowledge of any of this. The
listening socket (binding, accepting with the peer's credentials) is ``door_listener.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
from collections.abc import Callable

from tether.shared import framing, protocol, zmtp
from tether.shared.door_caps import IN, INFLIGHT, OUT, Caps, Limits, LogBudget
from tether.shared.door_conn import Conn
from tether.shared.door_listener import Listener
from tether.shared.errors import Busy, TetherError
from tether.shared.text import clip
from tether.shared.timers import Timer, Timers

TYPE_CHECKING = False
if TYPE_CHECKING:
    from tether.shared.door_conn import Sender

_READ = 1 << 16
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_ERR = select.EPOLLERR | select.EPOLLHUP

OnRequest = Callable[[Conn, protocol.Request], None]

_LIMITS = Limits()  # the default caps (frozen: one instance serves every door)


class Door:
    def __init__(self, path: str, timers: Timers, on_request: OnRequest, *, name: str,
                 log: logging.Logger, limits: Limits = _LIMITS,
                 privileged: frozenset[int] | None = None,
                 on_close: Callable[[Conn], None] | None = None,
                 listen_fd: int | None = None,
                 persons: Callable[[int], int] | None = None) -> None:
        self.path = path
        self.timers = timers
        self.on_request = on_request
        self.on_close = on_close
        self.name = name
        self.log = log
        self.caps = Caps(limits, privileged if privileged is not None
                         else frozenset({0, os.getuid()}), persons)
        self.conns: dict[int, Conn] = {}
        self.ready: set[Conn] = set()
        #: connections waiting for their uid's bucket to refill
        self.throttled: set[Conn] = set()
        #: connections waiting for everyone's unread replies to fall under their total
        #: (door_caps.py, ``starved``)
        self.starved: set[Conn] = set()
        self.throttle_timer: Timer | None = None
        self.last_refusal_log = -1e9
        self.log_budget = LogBudget()
        self.refused = 0
        #: connections closed to make room for another person (door_caps.py, the totals)
        self.evicted = 0
        self.ep = select.epoll()
        self.kick_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.ep.register(self.kick_fd, _IN)
        self.listener = Listener(path, listen_fd)
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
        if conn.closed:  # what it held was given back when it closed
            conn.inflight = max(0, conn.inflight - 1)
            return
        if conn.inflight > 0:
            conn.inflight -= 1
            self.caps.account(conn, inflight=-1)
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
        if not conn.closed and not conn.privileged:
            # everyone's unread replies past their total: the largest of the person holding
            # the most is closed (this one, if it is that: its peer is not reading)
            self._make_room(OUT, 0, None)
        if not conn.closed:
            self._arm(conn)
            self._wake_uid(conn.person)

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
        self.listener.close(unlink)

    def stats(self) -> dict[str, int]:
        return {"connections": len(self.conns), "refused": self.refused,
                "evicted": self.evicted,
                "queued_bytes": sum(c.out_bytes for c in self.conns.values()),
                "buffered_bytes": sum(c.deframer.buffered for c in self.conns.values())}

    # ---- connections -----------------------------------------------------------------------

    def _accept(self) -> None:
        caps = self.caps
        for sock, pid, uid, gid in self.listener.accept():
            conn = Conn(sock, uid, gid, pid)
            conn.privileged = uid in caps.privileged
            conn.person = caps.person_of(uid)
            why = caps.over_cap(conn)
            if why is None and not conn.privileged and caps.conns_open >= caps.conns_total:
                # every slot is taken: the person holding the most yields one, unless this
                # one's own person holds as many
                got = caps.conn_yielder(conn)
                if isinstance(got, str):
                    why = got
                elif got is not None:
                    self._evict(got, f"{caps.conns_open} connections open (at most "
                                f"{caps.conns_total}): {caps.who(got)}, holding the most, "
                                f"yields one to {caps.who(conn)}")
            if why is not None:
                self.refused += 1
                self._refusal(f"refused a connection from uid {uid} pid {pid}: {why}")
                with contextlib.suppress(OSError):  # best effort: one line for the client
                    sock.send(framing.frame(protocol.encode_reply(
                        protocol.error(None, Busy(f"{self.name}: {why}; try again later")))))
                sock.close()
                continue
            conn.door = self
            self.conns[conn.fd] = conn
            self.caps.joined(conn)
            conn.mask = _IN
            self.ep.register(conn.fd, _IN)
        if self.listener.full is not None:
            self._refusal(f"cannot accept: {self.listener.full}; pausing 100 ms")
            self.ep.modify(self.listener.fileno(), 0)
            self.timers.at(time.monotonic() + 0.1, self._resume_accept)

    def _resume_accept(self) -> None:
        if not self.closed:
            self.ep.modify(self.listener.fileno(), _IN)

    def _drop(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self.conns.pop(conn.fd, None)
        self.caps.left(conn)
        conn.out.clear()
        conn.out_bytes = 0
        with contextlib.suppress(OSError, ValueError):
            self.ep.unregister(conn.fd)
        conn.sock.close()
        self.ready.discard(conn)
        self.throttled.discard(conn)
        self.starved.discard(conn)
        if self.on_close is not None:
            self.on_close(conn)
        self._wake_uid(conn.person)
        self._wake_starved()

    def _evict(self, conn: Conn, why: str) -> None:
        """Close ``conn`` to make room for another person (``_make_room``), telling its peer
        why in one ``busy`` frame if its socket takes it."""
        self.evicted += 1
        self._refusal(f"closed a connection of {conn}: {why}")
        if not conn.out:  # between frames (else a reply is half sent: just close)
            with contextlib.suppress(OSError):  # best effort: one line for the client
                conn.sock.send(framing.frame(protocol.encode_reply(protocol.error(
                    None, Busy(f"{self.name}: {why}; try again later")))))
        self._drop(conn)

    def _make_room(self, kind: str, more: int, reader: Conn | None) -> None:
        """Everyone's ``kind`` would pass its total with ``more``: close the connections
        holding the most of it of the persons holding the most (never ``reader``) until it
        would not, or nobody else holds any (door_caps.py, ``yielder``)."""
        caps = self.caps
        while caps.full(kind, more):
            victim = caps.yielder(kind, reader)
            if victim is None:
                return
            what = {IN: "bytes of partial frames", OUT: "bytes of unread replies",
                    INFLIGHT: "requests in flight"}[kind]
            self._evict(victim, f"{caps.totals[kind]} {what} held by all (at most "
                        f"{caps.caps[kind]}): {caps.who(victim)} holds the most")

    # ---- reading ---------------------------------------------------------------------------

    def _read(self, conn: Conn) -> None:
        if not self.caps.may_take(conn) or conn.deframer.buffered > protocol.MAX_FRAME \
                or not self.caps.may_buffer(conn):  # as it is now, not as when it was armed
            self._arm(conn)
            return
        if not conn.privileged:
            self._make_room(IN, _READ, conn)
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
        self.caps.account(conn, inn=len(data))
        self._process(conn)
        if not conn.closed:
            self._arm(conn)

    def _process(self, conn: Conn) -> None:
        """Take the complete frames buffered for ``conn`` while its caps allow."""
        while not conn.closed and self.caps.may_take(conn):
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
                self._took(conn)
                self._bad(conn, str(exc), None)
                conn.closing = True  # the stream cannot be resynchronised: answer, then close
                self._taken(conn, conn.deframer.buffered)
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
            self._taken(conn, before - conn.deframer.buffered)
            self._took(conn)
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

    def _took(self, conn: Conn) -> None:
        """One more request of ``conn`` in flight; past everyone's total, the person holding
        the most yields."""
        if not conn.privileged:
            self._make_room(INFLIGHT, 1, conn)
        conn.inflight += 1
        self.caps.account(conn, inflight=1)

    def _taken(self, conn: Conn, size: int) -> None:
        """``size`` bytes of ``conn``'s buffer are gone (a frame taken or dropped): if its uid
        was over its partial-frame cap, its paused connections may go on (door_caps.py,
        ``may_buffer``: the next one to finish is picked, or all once under the cap)."""
        over = self.caps.over_in(conn.person)
        self.caps.account(conn, inn=-size)
        if over:
            self._wake_uid(conn.person)

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
        if now - conn.last_bad_log >= 1.0 and self.log_budget.take(now):
            conn.last_bad_log = now
            if self.log_budget.dropped:
                self.log.warning("%s: %d more bad requests not logged", self.name,
                                 self.log_budget.dropped)
                self.log_budget.dropped = 0
            self.log.warning("%s: %s", self.name, line if str(conn) in line
                             else f"{line} ({conn})")

    def _spend(self, conn: Conn) -> bool:
        """Take one token from the uid's bucket; False (and a refill timer) when empty."""
        refill = self.caps.spend(conn)
        if refill is None:
            return True
        if self.throttle_timer is None:
            self.throttle_timer = self.timers.at(refill, self._unthrottle)
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
        self.caps.account(conn, out=len(data))

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
            self.caps.account(conn, out=-sent_total)
            self._wake_uid(conn.person)
            self._wake_starved()
        if conn.closing and not conn.out:
            self._drop(conn)
            return
        self._arm(conn)

    # ---- readiness -------------------------------------------------------------------------

    def _arm(self, conn: Conn) -> None:
        if conn.closed:
            return
        mask = _OUT if conn.out else 0
        if not conn.privileged and self.caps.starved(self.caps.out_by_uid.get(conn.person, 0)):
            self.starved.add(conn)
        if (self.caps.may_take(conn) and conn not in self.throttled
                and self.caps.may_buffer(conn)):
            if conn.deframer.wanted() > 0 or not conn.deframer.buffered:
                mask |= _IN
            else:  # a whole frame is waiting: take it in service(), without a read
                self.ready.add(conn)
                self._kick()
        if mask != conn.mask:
            conn.mask = mask
            self.ep.modify(conn.fd, mask)

    def _wake_uid(self, person: int) -> None:
        """A budget of ``person`` shrank: its paused connections may go on."""
        for conn in self.caps.by_uid.get(person, ()):
            if not conn.mask & _IN and self.caps.may_take(conn) and conn not in self.throttled:
                self.ready.add(conn)
        if self.ready:
            self._kick()

    def _wake_starved(self) -> None:
        """Everyone's unread replies are back under their total: whoever waited for that may
        go on."""
        if self.starved and self.caps.totals[OUT] <= self.caps.limits.out_total:
            waiting, self.starved = self.starved, set()
            for conn in waiting:
                if not conn.closed:
                    self.ready.add(conn)
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
           pending: object, door: Sender | None = None) -> None:
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
