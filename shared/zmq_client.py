"""A blocking request/reply client over a ZeroMQ DEALER: for daemons of tether 0.1, which serve
ZeroMQ where today's serve a door (``client.Client`` switches to it when it meets one), and the
socket options the agent's links to supervisors share (``configure``).

Every call has a deadline. After a timeout the socket is closed with linger 0 and a fresh one
opened for the next call: libzmq would otherwise deliver the timed-out request to a restarted
server later, and a late reply could be taken for the answer to the next request.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from tether.shared import protocol
from tether.shared.errors import Unreachable


def configure(sock: zmq.Socket[Any]) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # The agent connects before a new supervisor has bound its socket (its start-up takes
    # ~150 ms); libzmq's doubling back-off would then add up to the last interval again. A flat
    # 10 ms retry costs nothing while the peer is absent and delivers within 10 ms of the bind.
    sock.setsockopt(zmq.RECONNECT_IVL, 10)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME)


class Client:
    """One connection to one endpoint (a supervisor's or the agent's socket)."""

    _ids = itertools.count(1)

    def __init__(self, path: str, *, timeout: float = 5.0,
                 ctx: zmq.Context[Any] | None = None) -> None:
        self.path = path
        self.endpoint = "ipc://" + path
        self.timeout = timeout
        self._ctx = ctx or zmq.Context.instance()
        self._sock: zmq.Socket[Any] | None = None
        #: the version to speak (set by ``client.Client``, which negotiated it); None: the
        #: oldest version that has each kind
        self.protocol: int | None = None
        # distinct per process so two clients never confuse each other's ids in logs
        self._prefix = os.getpid() << 20

    def _socket(self) -> zmq.Socket[Any]:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            configure(sock)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, kind: str, args: dict[str, Any] | None = None, *,
             timeout: float | None = None, watch: Callable[[], None] | None = None,
             watch_interval: float = 0.25) -> Any:
        """Send one request; return its result or raise RemoteError / Unreachable.

        ``watch``, if given, is called every ``watch_interval`` seconds while the reply is
        awaited (a long poll, say); whatever it raises abandons the request (the socket is
        closed, as after a timeout) and propagates.
        """
        budget = self.timeout if timeout is None else timeout
        rid = self._prefix + next(self._ids)
        sock = self._socket()
        v = protocol.version_for(kind, self.protocol)
        frame = protocol.encode_request(protocol.Request(id=rid, kind=kind, args=args or {},
                                                         v=v))
        deadline = time.monotonic() + budget
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            pass  # queued once the connection exists; the deadline below still holds
        except zmq.ZMQError as exc:
            self.close()
            raise Unreachable(f"cannot send {kind!r} to {self.path}: {exc}") from None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise Unreachable(f"no reply to {kind!r} from {self.path} within {budget:g}s")
            if watch is not None and left > watch_interval:
                if not sock.poll(int(watch_interval * 1000), zmq.POLLIN):
                    try:
                        watch()
                    except BaseException:
                        self.close()
                        raise
                    continue
            elif not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                continue  # the deadline check above gives up
            try:
                reply = protocol.decode_reply(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            if reply.id is not None and reply.id != rid:
                continue  # a stale reply to an earlier request
            return reply.unwrap()
