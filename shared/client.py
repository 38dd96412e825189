"""A blocking client of a door (the agent's or a supervisor's), for the CLI, tests and tools.

One connection to one path, length-prefixed msgpack frames (``framing.py``). Every call has a
deadline; after a timeout the connection is closed and a fresh one opened for the next call, so
a late reply is never taken for the answer to a later request.

A daemon of tether 0.1 serves ZeroMQ at the same path; it greets first with ZMTP's signature
(0xFF ...), which no door ever sends. Then, and only then, ZeroMQ is imported and the rest of
this client's calls go through ``zmq_client`` (``legacy`` says so).
"""

from __future__ import annotations

import _socket
import errno
import itertools
import os
import select
import time

from tether.shared import framing, protocol
from tether.shared.errors import TetherError, Unreachable

# ``_socket``, not ``socket``: socket.py turns the module's constants into IntEnums at import
# (enum and selectors with it), ~2-3 ms of every tether command; this client needs only what
# socket.socket inherits from _socket.socket (connect, send, recv, timeouts, close).
TYPE_CHECKING = False  # typing (and collections) cost every CLI run ~2 ms: type checker only
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def probe_unix(path: str, timeout: float = 1.0) -> str | None:
    """Connect a plain AF_UNIX socket: None if someone accepts, else why not (in well under a
    millisecond)."""
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    s.settimeout(timeout)
    try:
        s.connect(path)
    except BlockingIOError:
        return None  # its backlog is full: someone listens, and is busy refusing a flood
    except OSError as exc:
        return why_unreachable(exc)
    finally:
        s.close()
    return None


def why_unreachable(exc: OSError) -> str:
    """Why connecting to a socket failed, in the words ``probe_unix`` uses."""
    if isinstance(exc, FileNotFoundError):
        return "no socket"
    if isinstance(exc, ConnectionRefusedError):
        return "nobody is listening (stale socket)"
    if isinstance(exc, PermissionError):
        return "permission denied"
    return exc.strerror or str(exc)


class NotListening(Unreachable):
    """``Client.connect`` found nobody to talk to (``why``: as ``probe_unix`` says it)."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


class _Zmtp(Exception):
    """The peer greeted in ZMTP: a tether 0.1 daemon."""


class Client:
    """One connection to one door."""

    _ids = itertools.count(1)

    def __init__(self, path: str, *, timeout: float = 5.0) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: _socket.socket | None = None
        self._fresh = False
        self._deframer = framing.Deframer()
        #: a ZeroMQ client, once the peer turned out to be a tether 0.1 daemon
        self.legacy: Any = None
        # distinct per process so two clients never confuse each other's ids in logs
        self._prefix = os.getpid() << 20
        #: the version ``hello`` negotiated, and the release the server said it is (None before
        #: a hello: each request then goes out in the oldest version that has its kind)
        self.protocol: int | None = None
        self.release: str | None = None

    def connect(self) -> None:
        """Connect now (else the first call does): ``NotListening`` if nobody accepts. Instead
        of a ``probe_unix`` first, which costs the server a connection of its own."""
        self._connected(time.monotonic() + self.timeout)

    def _connected(self, deadline: float) -> _socket.socket:
        if self._sock is None:
            s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
            while True:
                s.settimeout(max(0.001, deadline - time.monotonic()))
                try:
                    s.connect(self.path)
                    break
                except BlockingIOError:
                    # the door's backlog is full (a flood of connections it is refusing or
                    # closing): that passes; try again until the deadline
                    if time.monotonic() < deadline:
                        time.sleep(0.005)
                        continue
                    s.close()
                    raise NotListening(f"cannot connect to {self.path}: its backlog stayed "
                                       "full", "its backlog stayed full") from None
                except OSError as exc:
                    s.close()
                    raise NotListening(f"cannot connect to {self.path}: "
                                       f"{exc.strerror or exc}", why_unreachable(exc)) from None
            s.setblocking(False)
            self._sock = s
            self._fresh = True  # nothing exchanged on it yet (``call``: a ZeroMQ peer?)
            self._deframer = framing.Deframer()
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.legacy is not None:
            self.legacy.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, kind: str, args: dict[str, Any] | None = None, *,
             timeout: float | None = None, watch: Callable[[], None] | None = None,
             watch_interval: float = 0.25) -> Any:
        """Send one request; return its result or raise RemoteError / Unreachable.

        ``watch``, if given, is called every ``watch_interval`` seconds while the reply is
        awaited (a long poll, say); whatever it raises abandons the request (the connection is
        closed, as after a timeout) and propagates.
        """
        if self.legacy is not None:
            self.legacy.protocol = self.protocol  # as negotiated by hello, through it
            return self.legacy.call(kind, args, timeout=timeout, watch=watch,
                                    watch_interval=watch_interval)
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        rid = self._prefix + next(self._ids)
        v = protocol.version_for(kind, self.protocol)
        data = framing.frame(protocol.encode_request(
            protocol.Request(id=rid, kind=kind, args=args or {}, v=v)))
        fresh = self._sock is None or self._fresh
        self._fresh = False
        try:
            try:
                return self._exchange(kind, rid, data, budget, deadline, watch, watch_interval)
            except Unreachable:
                # A ZeroMQ peer may reset the connection over our frame before we read its
                # greeting: on a fresh connection's failure, listen first, send nothing.
                if fresh and self._first_words(deadline):
                    raise _Zmtp() from None
                raise
        except _Zmtp:
            self.close()
            from tether.shared import zmq_client  # only for a 0.1 daemon: keeps zmq off the CLI
            self.legacy = zmq_client.Client(self.path, timeout=self.timeout)
            self.legacy.protocol = self.protocol
            return self.legacy.call(kind, args, timeout=max(0.1, deadline - time.monotonic()),
                                    watch=watch, watch_interval=watch_interval)
        except BaseException:
            self.close()
            raise

    def _exchange(self, kind: str, rid: int, data: bytes, budget: float, deadline: float,
                  watch: Callable[[], None] | None, watch_interval: float) -> Any:
        sock = self._connected(deadline)
        view = memoryview(data)
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLOUT)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unreachable(f"no reply to {kind!r} from {self.path} within {budget:g}s")
            wait = min(left, watch_interval) if watch is not None else left
            if not view:
                poller.modify(sock, select.POLLIN)
            events = poller.poll(int(wait * 1000) + 1)
            if not events:
                if watch is not None:
                    watch()
                continue
            flags = events[0][1]
            if view and flags & select.POLLOUT:
                try:
                    view = view[sock.send(view):]
                except BlockingIOError:
                    pass
                except OSError as exc:
                    self._maybe_zmtp()
                    raise Unreachable(f"cannot send {kind!r} to {self.path}: "
                                      f"{exc.strerror or exc}") from None
            if not flags & (select.POLLIN | select.POLLHUP | select.POLLERR):
                continue
            try:
                chunk = sock.recv(1 << 16)
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                self._maybe_zmtp()
                raise Unreachable(f"connection to {self.path} failed during {kind!r}: "
                                  f"{exc.strerror or exc}") from None
            if not chunk:
                self._maybe_zmtp()
                raise Unreachable(f"{self.path} closed the connection during {kind!r}")
            self._deframer.feed(chunk)
            reply = self._reply(rid)
            if reply is not None:
                return reply.unwrap()

    def _first_words(self, deadline: float) -> bool:
        """What the peer says unasked on a new connection: True for a ZMTP greeting (a 0.1
        daemon); a door's one refusal frame (``busy``) is raised as the ``RemoteError`` it
        is; anything else, nothing (False): the caller's error stands."""
        self.close()
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
        d = framing.Deframer()
        try:
            s.settimeout(max(0.01, min(0.5, deadline - time.monotonic())))
            s.connect(self.path)
            while True:
                data = s.recv(1 << 16)
                if not data:
                    return False
                if framing.looks_like_zmtp(data) and not d.buffered:
                    return True
                d.feed(data)
                payload = d.next()
                if payload is not None:
                    break
        except (OSError, framing.FrameTooLarge):
            return False
        finally:
            s.close()
        try:
            reply = protocol.decode_reply(payload)
        except TetherError:
            return False
        if reply.id is None and not reply.ok:
            reply.unwrap()  # raises RemoteError: busy, say
        return False

    def _maybe_zmtp(self) -> None:
        if framing.looks_like_zmtp(bytes(self._deframer.buf[:1])):
            raise _Zmtp()

    def _reply(self, rid: int) -> protocol.Reply | None:
        """The reply to ``rid`` if it is buffered; stale replies are skipped."""
        while True:
            self._maybe_zmtp()
            try:
                payload = self._deframer.next()
            except framing.FrameTooLarge as exc:
                raise Unreachable(f"{self.path} sent a bad frame ({exc})") from None
            if payload is None:
                return None
            try:
                reply = protocol.decode_reply(payload)
            except TetherError as exc:
                raise Unreachable(f"{self.path} sent an undecodable reply: {exc.message}") \
                    from None
            if reply.id is not None and reply.id != rid:
                continue  # a stale reply to an earlier request
            return reply

    def hello(self, **kw: Any) -> dict[str, Any]:
        """Negotiate the protocol version; later calls are sent in it."""
        res: dict[str, Any] = self.call("hello", {"versions": sorted(protocol.SUPPORTED_VERSIONS)},
                                        **kw)
        if res.get("protocol") in protocol.SUPPORTED_VERSIONS:
            self.protocol = int(res["protocol"])
        self.release = str(res.get("version", "?"))
        return res
