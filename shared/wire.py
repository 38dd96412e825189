"""Server-side framing of a supervisor's ZeroMQ ROUTER, reachable by the agent's uid only (I/O).

People never get here: they use the doors (``door.py``). A ROUTER receives [routing id,
payload]; the payload frame carries the kernel's credentials of the connecting peer
(``Peer-Address`` = "host:uid:gid:pid", from SO_PEERCRED at connect time).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import zmq

from tether.shared import protocol
from tether.shared.errors import BadRequest, TetherError
from tether.shared.text import clip

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Peer:
    routing_id: bytes
    uid: int
    gid: int
    pid: int
    #: a REQ client sends an empty delimiter frame and expects it back
    delimited: bool = False
    #: the protocol version its request spoke: the reply answers in it
    v: int = protocol.PROTOCOL_VERSION

    @property
    def key(self) -> bytes:
        return self.routing_id

    def __str__(self) -> str:
        return f"uid {self.uid} pid {self.pid}"


def parse_peer_address(value: str) -> tuple[int, int, int]:
    """'host:uid:gid:pid' -> (uid, gid, pid); (-1, -1, -1) if the kernel gave us nothing."""
    parts = value.rsplit(":", 3)
    try:
        return int(parts[1]), int(parts[2]), int(parts[3])
    except (IndexError, ValueError):
        return -1, -1, -1


def bind_router(ctx: zmq.Context[Any], path: str) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME)
    sock.bind("ipc://" + path)
    return sock


def receive(sock: zmq.Socket[Any]) -> tuple[Peer, protocol.Request] | None:
    """The next valid request, or None when none is waiting.

    Malformed input is answered here with an error envelope and skipped; it never raises.
    """
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        routing_id = frames[0].bytes
        payload = frames[-1]
        try:
            uid, gid, pid = parse_peer_address(str(payload.get("Peer-Address")))
        except zmq.ZMQError:
            uid, gid, pid = -1, -1, -1
        peer = Peer(routing_id, uid, gid, pid, len(frames) == 3 and not frames[1].bytes)
        data = payload.bytes
        try:
            # A DEALER sends one frame, a REQ an empty delimiter and then one: anything else
            # is not our protocol.
            if len(frames) != 2 and not peer.delimited:
                raise BadRequest(f"expected one payload frame, got {len(frames) - 1}")
            req = protocol.decode_request(data)
            return dataclasses.replace(peer, v=req.v), req
        except TetherError as exc:
            rid = getattr(exc, "request_id", None)
            if rid is None:
                rid = protocol.peek_id(data)
            log.warning("bad request from %s: %s", peer, clip(exc.message))
            send(sock, peer, protocol.error(rid, exc))


def send(sock: zmq.Socket[Any], peer: Peer, reply: protocol.Reply) -> None:
    try:
        head = [peer.routing_id, b""] if peer.delimited else [peer.routing_id]
        sock.send_multipart([*head, protocol.encode_reply(reply, peer.v)], zmq.NOBLOCK)
    except zmq.ZMQError as exc:  # peer gone or its queue full: the reply is simply dropped
        log.debug("reply to %s dropped: %s", peer, exc)
