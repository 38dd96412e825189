"""The agent's endpoint of a supervisor: a ZeroMQ ROUTER on ``ctl/sock`` (I/O).

Who reaches it. ``ctl/`` is a 0700 directory of the supervisor's uid (root's, under a root
agent): ``connect()`` needs search permission on it, so only that uid (and root) can open a
connection at all. libzmq is therefore never exposed to another user: it aborts the process on
some hostile input (a routing id that collides with its own counter) and lets a ROUTER's peer
choose its routing id, which is why people's doors stay plain AF_UNIX (docs/security.md). Each
request still carries the kernel's credentials of its connection (``Peer-Address``, libzmq's
``SO_PEERCRED`` at accept: ":uid:gid:pid"), and handlers.py authorizes every verb by that uid,
as for a door's connection.

The socket. It is bound on the listening AF_UNIX socket the supervisor made itself and keeps for
its life and across an upgrade's exec (handover.py): libzmq's ``ZMQ_USE_FD`` is given a copy,
which libzmq closes with the ROUTER; connections not accepted yet wait in the kernel's backlog.
``MAXMSGSIZE = MAX_FRAME``: libzmq drops a connection that announces a larger message before
buffering any of it. ``LINGER`` is set at close: the last replies (``ack``'s, or everything
parked answered ``upgrading`` before an exec) are delivered for up to ``CLOSE_LINGER_MS`` while
the context terminates; no reply is dropped by the close itself.

The context is made here, in the supervisor, never in the warm template it was forked from
(template.py imports pyzmq, which starts no thread and registers no at-fork handler): libzmq's
I/O and reaper threads exist only in the process that owns them.

Polling. ``fileno()`` is libzmq's ``ZMQ_FD``: it signals that the socket's mailbox has commands,
not that a message is waiting, and whoever processes them (a receive, a send) may take the
signal of an arrived message with it. So ``service()`` receives with ``NOBLOCK`` until
``Again`` after every wake, and ``settle()``, which the loop calls after each turn's other
work, drains again if anything was sent since (a reply from a timer or a reaped task).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from tether.shared import protocol
from tether.shared.errors import BadRequest, TetherError
from tether.shared.text import clip

log = logging.getLogger("tether.supervisor")

#: how long the last replies (to ``ack``, or ``upgrading`` before an exec) may take to leave
CLOSE_LINGER_MS = 1000
#: bad requests logged at most this often (the agent never sends one: a bug, not a flood)
BAD_LOG_EVERY = 1.0


class CtlPeer:
    """The agent, as the handlers see it: the kernel's uid, gid and pid of its connection, the
    routing id its replies go to, and the protocol version each of its requests spoke."""

    __slots__ = ("routing_id", "uid", "gid", "pid", "delimited", "door", "versions")

    def __init__(self, ctl: Ctl, routing_id: bytes, uid: int, gid: int, pid: int,
                 delimited: bool) -> None:
        self.door = ctl
        self.routing_id = routing_id
        self.uid, self.gid, self.pid = uid, gid, pid
        #: a REQ sends an empty delimiter frame and expects it back
        self.delimited = delimited
        self.versions: dict[protocol.RequestId, int] = {}

    @property
    def key(self) -> tuple[str, bytes]:
        return ("ctl", self.routing_id)

    def __str__(self) -> str:
        return f"uid {self.uid} pid {self.pid}"


OnRequest = Callable[[CtlPeer, protocol.Request], None]


class Ctl:
    def __init__(self, path: str, listen_fd: int, on_request: OnRequest) -> None:
        self.path = path
        self.on_request = on_request
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock: zmq.Socket[Any] = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)  # until ``close`` gives the last replies time
        self.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME)
        fd = os.dup(listen_fd)  # libzmq closes the one it is given; ours stays for life
        os.set_blocking(fd, False)
        self.sock.setsockopt(zmq.USE_FD, fd)
        self.sock.bind("ipc://" + path)
        self.bound_ino = os.stat(path).st_ino
        self.fd = int(self.sock.getsockopt(zmq.FD))
        #: sent on since the last drain: the signal of an arrived message may be spent
        self.dirty = True
        self.last_bad_log = -1e9
        self.closed = False

    def fileno(self) -> int:
        return self.fd

    def service(self) -> None:
        """Every request waiting, each handed to ``on_request``; never blocks."""
        while not self.closed:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._one(frames)
        self.dirty = False

    def settle(self) -> None:
        """After a turn's other work: drain again if a send may have taken a wake-up."""
        if self.dirty and not self.closed:
            self.service()

    def _one(self, frames: list[zmq.Frame]) -> None:
        payload = frames[-1]
        try:
            _, uid, gid, pid = str(payload.get("Peer-Address")).rsplit(":", 3)
            creds = int(uid), int(gid), int(pid)
        except (zmq.ZMQError, ValueError):
            creds = (-1, -1, -1)  # unknown: handlers.py allows only the verbs of anyone
        delimited = len(frames) == 3 and not frames[1].bytes
        peer = CtlPeer(self, frames[0].bytes, *creds, delimited)
        data = payload.bytes
        try:
            # a DEALER sends one frame, a REQ an empty delimiter and then one
            if len(frames) != 2 and not delimited:
                raise BadRequest(f"expected one payload frame, got {len(frames) - 1}")
            req = protocol.decode_request(data)
        except TetherError as exc:
            rid = getattr(exc, "request_id", None)
            if rid is None:
                rid = protocol.peek_id(data)
            now = time.monotonic()
            if now - self.last_bad_log >= BAD_LOG_EVERY:
                self.last_bad_log = now
                log.warning("bad request on %s from %s: %s", self.path, peer, clip(exc.message))
            self.send(peer, protocol.error(rid, exc))
            return
        peer.versions[req.id] = req.v
        self.on_request(peer, req)

    def send(self, peer: CtlPeer, reply: protocol.Reply) -> None:
        """The one reply to one of ``peer``'s requests, in the version it spoke (dropped if
        the peer went away: a ROUTER drops what it cannot route)."""
        if self.closed:
            return
        v = peer.versions.pop(reply.id, protocol.PROTOCOL_VERSION) if reply.id is not None \
            else protocol.PROTOCOL_VERSION
        data = protocol.encode_reply(reply, v)
        if len(data) > protocol.MAX_FRAME:  # a handler's bug, not the peer's: say so
            log.error("reply to %s on %s is %d bytes, over the frame limit", peer, self.path,
                      len(data))
            data = protocol.encode_reply(protocol.error(
                reply.id, TetherError("internal error: reply too large")), v)
        head = [peer.routing_id, b""] if peer.delimited else [peer.routing_id]
        try:
            self.sock.send_multipart([*head, data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # its queue full (a peer that does not read): dropped
            log.debug("reply to %s dropped: %s", peer, exc)
        self.dirty = True

    def close(self, *, unlink: bool) -> None:
        """Deliver what was sent (``CLOSE_LINGER_MS`` at most), end the context and its
        threads; ``unlink`` the path if it is still the socket bound here, unless the next
        image of this process is to listen there (the listening socket is the caller's)."""
        if self.closed:
            return
        self.closed = True
        self.sock.close(linger=CLOSE_LINGER_MS)
        self.ctx.term()
        if not unlink:
            return
        try:  # never unlink a socket someone else bound at our path since
            if os.stat(self.path).st_ino == self.bound_ino:
                os.unlink(self.path)
        except OSError:
            pass
