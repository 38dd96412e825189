"""Just enough ZMTP 3 (RFC 23, NULL mechanism) for a door to answer a tether 0.1 client. Pure.

Release 0.1's CLI and tools talk ZeroMQ (a DEALER) to the very paths where doors now listen.
Rather than keep a libzmq ROUTER open to every user (whose routing ids a peer can choose, and
whose EMFILE aborts the process: ``door.py``), a door recognises the ZMTP greeting (it starts
with 0xFF, which as a length prefix would be far over the frame limit) and speaks the wire
format itself: greeting, READY (``Socket-Type`` ROUTER), then one-frame messages each way. The
connection keeps every cap of the door, and its peer is still the kernel's ``SO_PEERCRED``: no
routing id exists here at all.

Where it still serves: the doors (the agent's, each supervisor's at ``sock``) for 0.1 clients,
and the door a supervisor resumed from a handover-format-1 image serves the agent with at
``sock``. The agent's link to this release's supervisors is libzmq on both ends (ctl.py), and a
0.5/0.6 supervisor's ctl door carries its own copy of this codec. Removed in 0.8.0 with the
rest of the 0.1 compatibility (docs/operations.md, "End of life").

Only what a DEALER sends is accepted: single-frame messages of at most ``MAX_FRAME`` bytes.
Anything else (a multi-frame message, a mechanism other than NULL, a malformed greeting) is a
``ZmtpError``; the door then closes the connection.
"""

from __future__ import annotations

from tether.shared.framing import FrameTooLarge
from tether.shared.protocol import MAX_FRAME

GREETING_SIZE = 64
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04

#: ours: signature, version 3.0, mechanism NULL, as-server, filler
GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
            + b"\x01" + b"\x00" * 31)


class ZmtpError(FrameTooLarge):
    """The peer broke ZMTP (or asked for what a door does not do): close the connection."""

    def __init__(self, message: str) -> None:
        ValueError.__init__(self, message)
        self.size = 0


def _command(name: bytes, props: dict[bytes, bytes]) -> bytes:
    body = bytes([len(name)]) + name
    for key, value in props.items():
        body += bytes([len(key)]) + key + len(value).to_bytes(4, "big") + value
    if len(body) < 256:
        return bytes([_COMMAND, len(body)]) + body
    return bytes([_COMMAND | _LONG]) + len(body).to_bytes(8, "big") + body


READY = _command(b"READY", {b"Socket-Type": b"ROUTER"})


class Codec:
    """One ZMTP connection as the server sees it: bytes in, message payloads out."""

    def __init__(self, limit: int = MAX_FRAME) -> None:
        self.limit = limit
        self.buf = bytearray()
        self._out = bytearray(GREETING)  # sent at once: libzmq waits for our signature
        self._state = "greeting"
        self._frame: tuple[int, int, int] | None = None  # flags, header size, body size

    @property
    def buffered(self) -> int:
        return len(self.buf)

    def output(self) -> bytes:
        """Handshake bytes to send now (our greeting, our READY)."""
        out, self._out = bytes(self._out), bytearray()
        return out

    def feed(self, data: bytes) -> None:
        self.buf += data

    def wanted(self) -> int:
        if self._state == "greeting":
            return GREETING_SIZE - len(self.buf)
        if self._frame is None:
            return max(1, 9 - len(self.buf)) if self.buf else 1
        _, head, size = self._frame
        return head + size - len(self.buf)

    def frame(self, payload: bytes) -> bytes:
        """One message of one frame, as a ROUTER sends it to a DEALER."""
        if len(payload) < 256:
            return bytes([0, len(payload)]) + payload
        return bytes([_LONG]) + len(payload).to_bytes(8, "big") + payload

    def complete(self) -> bool:
        """Is a whole message buffered? Runs the handshake on the way. Raises ``ZmtpError``."""
        while True:
            if self._state == "greeting":
                if len(self.buf) < GREETING_SIZE:
                    return False
                greeting = bytes(self.buf[:GREETING_SIZE])
                del self.buf[:GREETING_SIZE]
                if greeting[0] != 0xFF or greeting[9] != 0x7F or greeting[10] < 3:
                    raise ZmtpError("not a ZMTP 3 greeting")
                if greeting[12:32].rstrip(b"\x00") != b"NULL":
                    raise ZmtpError("only the NULL mechanism is served")
                self._out += READY
                self._state = "ready"
                continue
            if not self._header():
                return False
            flags, head, size = self._frame  # type: ignore[misc]
            if len(self.buf) < head + size:
                return False
            if self._state == "ready":
                if not flags & _COMMAND:
                    raise ZmtpError("expected the peer's READY command")
                name_len = self.buf[head]
                if bytes(self.buf[head + 1:head + 1 + name_len]) != b"READY":
                    raise ZmtpError("expected the peer's READY command")
                del self.buf[:head + size]
                self._frame = None
                self._state = "traffic"
                continue
            if flags & _COMMAND:  # PING and the like: nothing a door needs to answer
                del self.buf[:head + size]
                self._frame = None
                continue
            if flags & _MORE:
                raise ZmtpError("multi-frame messages are not served (use a DEALER)")
            return True

    def next(self) -> bytes | None:
        if not self.complete():
            return None
        assert self._frame is not None
        _, head, size = self._frame
        payload = bytes(self.buf[head:head + size])
        del self.buf[:head + size]
        self._frame = None
        return payload

    def _header(self) -> bool:
        if self._frame is not None:
            return True
        if not self.buf:
            return False
        flags = self.buf[0]
        if flags & _LONG:
            if len(self.buf) < 9:
                return False
            size = int.from_bytes(self.buf[1:9], "big")
            head = 9
        else:
            if len(self.buf) < 2:
                return False
            size = self.buf[1]
            head = 2
        if size > self.limit:
            raise ZmtpError(f"frame of {size} bytes exceeds the {self.limit}-byte limit")
        self._frame = (flags, head, size)
        return True
