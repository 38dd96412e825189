"""One native connection of the agent to a supervisor's door: a plain AF_UNIX stream socket
carrying length-prefixed msgpack frames (``shared/framing.py``), never blocking (I/O).

Why not the ZeroMQ DEALER the agent used before: the supervisors of 0.5.0 serve their ``ctl/``
socket with a door, not a libzmq ROUTER, so the DEALER's machinery bought nothing but its cost:
a context whose I/O thread relays every byte, a socket, a connect and a close per job, each
through libzmq (bench/README.md: ~1 ms of CPU per job on the agent's side, 5% of a ``true``
job's). The DEALER stays for the supervisors of 0.1.0 to 0.4.0, which serve ZeroMQ: the link
switches to it when such a peer shows itself (agent/link.py).

A ``Conn`` is connected when it exists (``open`` raises ``OSError`` otherwise: nobody listening
yet, gone, or its backlog full). Frames to send queue whole (``out``: each with its request's
id), and what the socket's buffer does not take waits for the poller's "writable"
(``wants_write``). ``frames_unsent`` are the frames of which not one byte left: after the
connection dies they may go out on the next one, since the peer cannot have seen them.
"""

from __future__ import annotations

import collections
import errno
import socket
import struct

from tether.shared import framing
from tether.shared.protocol import MAX_FRAME

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: bytes taken per recv: a reply to the agent is small (a wait's exit record is the largest)
_RECV = 1 << 16


class Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.deframer = framing.Deframer(MAX_FRAME)
        #: (request id, whole frame) to send, oldest first; the first may be partly sent
        #: (``sent`` bytes of it)
        self.out: collections.deque[tuple[int, bytes]] = collections.deque()
        self.sent = 0
        #: anything received on this connection yet (a peer that closes before saying a
        #: word may be a libzmq ROUTER that refused our frame: agent/link.py)
        self.heard = False
        self.closed = False
        pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                    _UCRED.size))
        #: the kernel's view of the process that listens on the path (SO_PEERCRED: taken
        #: at listen(), kept across the exec of an upgrade, which keeps the pid)
        self.peer_pid, self.peer_uid = pid, uid

    @classmethod
    def open(cls, path: str) -> Conn:
        """Connect now: ``OSError`` if nobody accepts (ENOENT, ECONNREFUSED, EAGAIN: a full
        backlog), never a wait."""
        s = socket.socket(socket.AF_UNIX,
                          socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            s.connect(path)
        except BaseException:
            s.close()
            raise
        return cls(s)

    def fileno(self) -> int:
        return self.fd

    def __repr__(self) -> str:
        return f"<Conn fd={self.fd} out={len(self.out)}{' closed' if self.closed else ''}>"

    @property
    def wants_write(self) -> bool:
        return bool(self.out)

    def flush(self) -> None:
        """Write queued bytes until the socket's buffer is full or nothing is left. ``OSError``
        (EPIPE, ECONNRESET) if the connection is dead."""
        while self.out:
            head = self.out[0][1]
            try:
                n = self.sock.send(memoryview(head)[self.sent:] if self.sent else head)
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            self.sent += n
            if self.sent == len(head):
                self.out.popleft()
                self.sent = 0

    def frames_unsent(self) -> list[tuple[int, bytes]]:
        """The queued frames of which no byte was written (see the module's docstring)."""
        rest = list(self.out)
        return rest[1:] if self.sent else rest

    def receive(self) -> tuple[list[bytes], bool]:
        """Every whole frame received so far, and whether the peer closed. Raises
        ``framing.FrameTooLarge`` for a frame over ``MAX_FRAME`` and ``Zmtp`` if the peer
        greets in ZMTP (a libzmq ROUTER: the supervisors before 0.5.0)."""
        frames: list[bytes] = []
        eof = False
        while True:
            try:
                data = self.sock.recv(_RECV)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN):
                    eof = True
                    break
                raise
            if not data:
                eof = True
                break
            if not self.heard:
                self.heard = True
                if framing.looks_like_zmtp(data):
                    raise Zmtp()
            self.deframer.feed(data)
            while True:
                payload = self.deframer.next()
                if payload is None:
                    break
                frames.append(payload)
            if len(data) < _RECV:
                break
        return frames, eof

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


class Zmtp(Exception):
    """The peer greeted in ZMTP: a supervisor of 0.1.0 to 0.4.0 (a libzmq ROUTER)."""
