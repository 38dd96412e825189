"""One connection a door accepted: who is on the other end (from the kernel), its buffers and
what it owes; also the ``peer`` a request's handler sees.

Apart from ``door.py`` so that handlers and the caps (``door_caps.py``) can name a connection
without the serve loop: it is state only, every byte moves in ``door.py``.
"""

from __future__ import annotations

import socket
from collections import deque
from itertools import count

from tether.shared import framing, protocol, zmtp

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Protocol

    class Sender(Protocol):
        """What a connection needs of the door that accepted it (door.py's ``Door``), named
        here rather than imported: door.py imports this module."""

        def send(self, conn: Conn, reply: protocol.Reply) -> None: ...

        def note(self, conn: Conn, line: str) -> None: ...


class Conn:
    """One accepted connection; also the ``peer`` handlers see (uid, gid, pid from the kernel)."""

    _serials = count(1)

    def __init__(self, sock: socket.socket, uid: int, gid: int, pid: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.uid, self.gid, self.pid = uid, gid, pid
        #: who it counts as in the door's caps: its uid's login for a subordinate uid
        #: (door_caps.py), and whether it is root or the daemon's own uid
        self.person = uid
        self.privileged = False
        self.serial = next(self._serials)
        #: the door that accepted it, which every reply to it goes through (a daemon may have
        #: several: a supervisor's ctl door and its door)
        self.door: Sender | None = None
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
