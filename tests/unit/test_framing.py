"""The doors' wire, pure: length-prefixed frames, the ZMTP greeting and messages a tether 0.1
client sends, and the parking lot of long polls (no sockets, no processes)."""

from __future__ import annotations

import time

import pytest

from tether.shared import framing, zmtp
from tether.shared.parking import Lot
from tether.shared.protocol import MAX_FRAME
from tether.shared.timers import Timers


def test_frames_come_out_whole_however_the_bytes_arrive() -> None:
    wire = framing.frame(b"one") + framing.frame(b"") + framing.frame(b"x" * 70000)
    for step in (1, 3, 4096, len(wire)):
        d = framing.Deframer()
        got = []
        for i in range(0, len(wire), step):
            d.feed(wire[i:i + step])
            while (p := d.next()) is not None:
                got.append(p)
        assert got == [b"one", b"", b"x" * 70000]
        assert d.buffered == 0


def test_an_oversized_frame_is_refused_from_its_header_alone() -> None:
    d = framing.Deframer()
    d.feed(framing.HEADER.pack(MAX_FRAME + 1))
    with pytest.raises(framing.FrameTooLarge):
        d.complete()
    with pytest.raises(framing.FrameTooLarge):
        framing.frame(b"x" * (MAX_FRAME + 1))
    d = framing.Deframer()
    d.feed(framing.HEADER.pack(MAX_FRAME) + b"x" * 10)
    assert d.complete() is False and d.wanted() == MAX_FRAME - 10


def client_greeting() -> bytes:
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + \
        b"\x00" + b"\x00" * 31


def test_zmtp_handshake_and_one_frame_messages() -> None:
    c = zmtp.Codec()
    assert c.output() == zmtp.GREETING  # sent at once: libzmq waits for our signature
    ready = b"\x04" + bytes([len(b"\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER")]) + \
        b"\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER"
    long_body = b"y" * 300
    wire = client_greeting() + ready + b"\x00\x03abc" + b"\x04\x05\x04PING" + b"\x02" + \
        len(long_body).to_bytes(8, "big") + long_body
    for i in range(len(wire)):  # byte by byte
        c.feed(wire[i:i + 1])
        c.complete()
    assert c.output() == zmtp.READY
    assert c.next() == b"abc"
    assert c.next() == long_body  # the PING command in between is skipped
    assert c.next() is None
    assert c.frame(b"hi") == b"\x00\x02hi"
    assert c.frame(long_body)[:9] == b"\x02" + (300).to_bytes(8, "big")


@pytest.mark.parametrize("wire, why", [
    (b"\xff" + b"\x00" * 63, "not a ZMTP 3 greeting"),
    (client_greeting().replace(b"NULL", b"PLAI"), "NULL mechanism"),
    (client_greeting() + b"\x00\x01x", "READY"),
    (client_greeting() + b"\x04\x06\x05READY" + b"\x01\x01a", "multi-frame"),
    (client_greeting() + b"\x04\x06\x05READY" + b"\x02" + (MAX_FRAME + 1).to_bytes(8, "big"),
     "exceeds"),
])
def test_zmtp_violations_close_the_connection(wire: bytes, why: str) -> None:
    c = zmtp.Codec()
    c.feed(wire)
    with pytest.raises(zmtp.ZmtpError, match=why):
        while c.complete():
            c.next()


def test_parked_requests_are_answered_once_by_whoever_comes_first() -> None:
    timers = Timers()
    lot: Lot[int, str] = Lot(timers)
    expired: list[str] = []

    class Peer:
        def __init__(self, key: str) -> None:
            self.key = key
    a, b = Peer("a"), Peer("b")
    lot.park(1, a, 10, 5.0, "a1", lambda p: expired.append(p.value))
    lot.park(1, b, 11, 1.0, "b1", lambda p: expired.append(p.value))
    lot.park(2, a, 12, 1.0, "a2", lambda p: expired.append(p.value))
    assert len(lot) == 3
    timers.run_due(time.monotonic() + 2.0)
    assert sorted(expired) == ["a2", "b1"] and len(lot) == 1
    assert [p.value for p in lot.take(1)] == ["a1"]
    timers.run_due(time.monotonic() + 10.0)
    assert sorted(expired) == ["a2", "b1"], "a taken request expired as well"
    lot.park(3, a, 13, 9.0, "a3", lambda p: expired.append(p.value))
    lot.park(3, b, 14, 9.0, "b3", lambda p: expired.append(p.value))
    assert lot.drop_peer("a") == 1
    assert [p.value for p in lot.take_if(3, lambda p: p.value == "b3")] == ["b3"]
    assert len(lot) == 0
