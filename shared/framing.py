"""Frames of the user doors: a 4-byte big-endian length, then one msgpack map. Pure.

The doors (``shared/door.py``) are plain ``AF_UNIX`` stream sockets, so message boundaries are
ours to draw. A peer declares each frame's size before sending it; the declared size is checked
against ``MAX_FRAME`` as soon as the four header bytes are in, before anything is allocated for
the body, and a reader never buffers more than one frame plus a header per connection.

A ZeroMQ peer (a tether 0.1 agent or supervisor still serving ZMTP on the same path) starts its
greeting with 0xFF, which as a length would be far over ``MAX_FRAME``: ``looks_like_zmtp``
tells a client it reached an old daemon rather than a broken one.
"""

from __future__ import annotations

import struct

from tether.shared.protocol import MAX_FRAME

HEADER = struct.Struct(">I")
#: The first byte of every ZMTP greeting (signature 0xFF, 8 padding bytes, 0x7F).
ZMTP_SIGNATURE = 0xFF


class FrameTooLarge(ValueError):
    """A peer declared a frame larger than the limit: the stream cannot be resynchronised."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the {limit}-byte limit")
        self.size = size


def frame(payload: bytes) -> bytes:
    """One frame on the wire: header and payload."""
    if len(payload) > MAX_FRAME:
        raise FrameTooLarge(len(payload), MAX_FRAME)
    return HEADER.pack(len(payload)) + payload


def looks_like_zmtp(data: bytes) -> bool:
    return bool(data) and data[0] == ZMTP_SIGNATURE


class Deframer:
    """Bytes in, whole frames out. ``wanted()`` says how much more a reader may take."""

    def __init__(self, limit: int = MAX_FRAME) -> None:
        self.limit = limit
        self.buf = bytearray()
        self._size: int | None = None  # body size of the frame being read, once known

    @property
    def buffered(self) -> int:
        return len(self.buf)

    def wanted(self) -> int:
        """Bytes still missing from the current frame (at least the header)."""
        if self._size is None:
            return HEADER.size - len(self.buf) if len(self.buf) < HEADER.size else 0
        return HEADER.size + self._size - len(self.buf)

    def feed(self, data: bytes) -> None:
        self.buf += data

    def output(self) -> bytes:
        """Bytes to send unasked: none (the ZMTP codec has a handshake)."""
        return b""

    def frame(self, payload: bytes) -> bytes:
        return frame(payload)

    def complete(self) -> bool:
        """Is a whole frame buffered? Raises ``FrameTooLarge`` once its header is in."""
        if self._size is None:
            if len(self.buf) < HEADER.size:
                return False
            (size,) = HEADER.unpack_from(self.buf)
            if size > self.limit:
                raise FrameTooLarge(size, self.limit)
            self._size = size
        return len(self.buf) >= HEADER.size + self._size

    def next(self) -> bytes | None:
        """The next complete frame's payload, or None. Raises ``FrameTooLarge``."""
        if self._size is None:
            if len(self.buf) < HEADER.size:
                return None
            (size,) = HEADER.unpack_from(self.buf)
            if size > self.limit:
                raise FrameTooLarge(size, self.limit)
            self._size = size
        end = HEADER.size + self._size
        if len(self.buf) < end:
            return None
        payload = bytes(self.buf[HEADER.size:end])
        del self.buf[:end]
        self._size = None
        return payload
