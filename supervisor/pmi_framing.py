"""Taking PMI messages off a rank's byte stream: PMI-1 lines (with over-long lines dropped and
PMI-1 spawn's multi-line ``mcmd`` blocks collected), PMI-2 length-prefixed frames.

Why a module of its own: this is the only part of the PMI server that deals in a rank's buffered
bytes, split anywhere by the reads that fed them; it turns them into whole requests (pmi.py's
``_Request``) and knows nothing of what they mean. The codec of one message is pmi_wire.py's;
the server (pmi.py) calls ``next_item`` from ``feed`` and dispatches what it returns. Every
limit here raises ``_StreamError`` (the rank's stream is abandoned) with a message that does not
depend on how the bytes were split. pmi.py imports this module at its end, once the classes it
uses exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.supervisor.pmi_state import _Rank, _Request, _StreamError, _Wire
from tether.supervisor.pmi_wire import (
    ABSURD_LINE_V1,
    MAX_COMMAND_V2,
    MAX_LINE_V1,
    V2_HEADER,
    V2_HEADER_LEN,
    PmiSyntaxError,
    parse_frame,
    parse_line,
    preview,
)

#: How much of a dropped over-long line is kept, to name its command in the error reply.
_HEAD_LEN = 64


@dataclass(frozen=True, slots=True)
class Overlong:
    """A PMI-1 line past MAX_LINE_V1 that was dropped; ``head`` names its command, if any."""

    head: bytes
    length: int


def next_item(st: _Rank) -> _Request | Overlong | None:
    """Take the next complete message off the rank's buffer, if there is one."""
    while True:
        if st.wire is _Wire.FRAMES:
            body = _take_frame(st)
            if body is None:
                return None
            st.messages += 1
            cmd, args = parse_frame(body)
            return _Request(st.rank, _Wire.FRAMES, cmd, args)
        line = _take_line(st)
        if line is None:
            return None
        st.messages += 1
        if isinstance(line, Overlong):
            if st.block is not None:
                raise _StreamError(f"a {line.length}-byte line inside a PMI-1 spawn block")
            return line
        if st.block is not None or line.startswith(b"mcmd="):
            request = _collect_block(st, line)
            if request is None:
                continue  # the block goes on
            return request
        cmd, args = parse_line(line)
        return _Request(st.rank, _Wire.LINES, cmd, args)


def _take_line(st: _Rank) -> bytes | Overlong | None:
    buf = st.buffer
    newline = buf.find(b"\n")
    if st.dropping:  # still inside an over-long line: discard up to its newline
        if newline < 0:
            st.dropping += len(buf)
            buf.clear()
            _check_absurd(st.dropping + 1)
            return None
        length = st.dropping + newline + 1
        del buf[: newline + 1]
        head, st.dropping, st.dropped_head = st.dropped_head, 0, b""
        _check_absurd(length)
        return Overlong(head, length)
    if newline < 0:
        if len(buf) >= MAX_LINE_V1:  # cannot end within the limit any more: stop buffering
            st.dropped_head, st.dropping = bytes(buf[:_HEAD_LEN]), len(buf)
            buf.clear()
            _check_absurd(st.dropping + 1)
        return None
    if newline + 1 > MAX_LINE_V1:
        _check_absurd(newline + 1)
        head = bytes(buf[:_HEAD_LEN])
        del buf[: newline + 1]
        return Overlong(head, newline + 1)
    line = bytes(buf[:newline])
    del buf[: newline + 1]
    return line


def _check_absurd(length: int) -> None:
    # The message must not depend on how the bytes were split, so it names no byte count.
    if length > ABSURD_LINE_V1:
        raise _StreamError(f"a PMI-1 line longer than {ABSURD_LINE_V1} bytes: this is not PMI")


def _take_frame(st: _Rank) -> bytes | None:
    buf = st.buffer
    if len(buf) < V2_HEADER_LEN:
        return None
    header = bytes(buf[:V2_HEADER_LEN])
    if not V2_HEADER.fullmatch(header):
        raise _StreamError(f"expected a 6-character PMI-2 length prefix, got {header!r}")
    length = int(header)
    if not 0 < length <= MAX_COMMAND_V2:
        raise _StreamError(f"PMI-2 command length {length} is outside 1..{MAX_COMMAND_V2}")
    if len(buf) < V2_HEADER_LEN + length:
        return None
    body = bytes(buf[V2_HEADER_LEN : V2_HEADER_LEN + length])
    del buf[: V2_HEADER_LEN + length]
    return body


def _collect_block(st: _Rank, line: bytes) -> _Request | None:
    """PMI-1 spawn: ``mcmd=spawn``, then ``k=v`` lines (values may hold spaces), ``endcmd``."""
    if st.block is None:
        st.block, st.block_bytes = [], 0
    st.block.append(line)
    st.block_bytes += len(line) + 1
    if st.block_bytes > ABSURD_LINE_V1:
        raise _StreamError(f"a PMI-1 mcmd block longer than {ABSURD_LINE_V1} bytes")
    if line.strip() != b"endcmd":
        return None
    lines, st.block = st.block, None
    args: dict[str, str] = {}
    for raw in lines[1:-1]:
        key, eq, value = raw.decode("latin-1").partition("=")
        if not eq or not key:
            raise PmiSyntaxError(f"expected key=value in an mcmd block, got {preview(key)}")
        args.setdefault(key, value)
    return _Request(st.rank, _Wire.LINES, lines[0].decode("latin-1")[5:], args)
