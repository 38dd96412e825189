"""shared/minipack.py against msgpack itself: the same bytes for the same values, the same values
from the same bytes, and the same frames refused (random values, the lengths where encodings
change, damaged and random frames), under tether's limits (protocol.UNPACK_LIMITS)."""

from __future__ import annotations

import math
import random
from typing import Any

import msgpack
import pytest

from tether.shared import minipack, protocol

LIMITS = protocol.UNPACK_LIMITS
EDGES = [0, 1, 15, 16, 31, 32, 255, 256, 65535, 65536]
INTS = [0, 1, 31, 32, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63,
        2**64 - 1, -1, -32, -33, -128, -129, -32768, -32769, -2**31, -2**31 - 1, -2**63]


def value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(10 if depth < 4 else 7)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        n = rng.choice(INTS) + rng.choice([0, 0, 1, -1])
        in_range = -2**63 <= n < 2**64
        return n if in_range and rng.random() < 0.5 else rng.randint(-2**63, 2**64 - 1)
    if kind == 2:
        return rng.choice([0.0, -0.0, 1.5, -2.25, 1e300, math.inf, -math.inf, rng.random()])
    if kind == 3:
        n = rng.choice(EDGES[:8]) if rng.random() < 0.2 else rng.randrange(40)
        return "".join(rng.choice("aé€\U0001f600 \n\x00\"\\") for _ in range(n))
    if kind == 4:
        return rng.randbytes(rng.choice(EDGES[:8]) if rng.random() < 0.2 else rng.randrange(40))
    if kind in (5, 6):
        return rng.choice(["", "job", "ok", "kind"]) if kind == 5 else rng.randrange(100)
    if kind == 7:
        items = [value(rng, depth + 1) for _ in range(rng.choice([0, 1, 3, 15, 16, 17]))]
        return items if rng.random() < 0.7 else tuple(items)
    return {f"k{i}{rng.random():.3f}": value(rng, depth + 1)
            for i in range(rng.choice([0, 1, 3, 15, 16, 17]))}


def outcome(unpack: Any, data: bytes, strict: bool) -> tuple[str, Any]:
    try:
        got = unpack(data, raw=False, strict_map_key=strict, **LIMITS)
    except Exception:  # which type differs (msgpack raises a zoo): refused is what counts
        return ("refused", None)
    return ("read", msgpack.packb(got))  # compared as bytes: NaN != NaN


@pytest.mark.parametrize("seed", range(3))
def test_the_same_bytes_and_the_same_values_as_msgpack(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(2000):
        v = value(rng)
        packed = msgpack.packb(v)
        assert minipack.packb(v) == packed, v
        assert outcome(minipack.unpackb, packed, False) == outcome(msgpack.unpackb, packed,
                                                                   False), v


def test_the_lengths_where_encodings_change() -> None:
    for n in EDGES + [2**16 + 3]:
        for v in ("x" * n, b"x" * n, [0] * n, {str(i): i for i in range(n)}):
            packed = msgpack.packb(v)
            assert minipack.packb(v) == packed, (type(v), n)
            assert minipack.unpackb(packed, strict_map_key=True, max_str_len=-1) == (
                list(v) if isinstance(v, tuple) else v)
    for n in INTS + [math.nan, 0.1, float(2**70)]:
        assert minipack.packb(n) == msgpack.packb(n), n
    with pytest.raises(OverflowError):
        minipack.packb(2**64)
    with pytest.raises(OverflowError):
        minipack.packb(-2**63 - 1)
    with pytest.raises(TypeError):
        minipack.packb({1, 2})
    float32 = b"\xca" + bytes.fromhex("3fc00000")
    assert minipack.unpackb(float32) == msgpack.unpackb(float32) == 1.5


@pytest.mark.parametrize("seed", range(3))
def test_damaged_and_random_frames_are_refused_as_msgpack_refuses_them(seed: int) -> None:
    rng = random.Random(100 + seed)
    for i in range(3000):
        frame = bytearray(msgpack.packb(value(rng)))
        how = i % 4
        if how == 0 and frame:
            frame = frame[:rng.randrange(len(frame))]
        elif how == 1 and frame:
            frame[rng.randrange(len(frame))] = rng.randrange(256)
        elif how == 2:
            frame += rng.randbytes(rng.randrange(1, 4))
        else:
            frame = bytearray(rng.randbytes(rng.randrange(1, 30)))
        data = bytes(frame)
        for strict in (True, False):
            assert outcome(minipack.unpackb, data, strict) == outcome(msgpack.unpackb, data,
                                                                      strict), data.hex()


def test_limits_ext_types_and_nesting() -> None:
    big = msgpack.packb("x" * 100)
    with pytest.raises(ValueError):
        minipack.unpackb(big, max_str_len=99)
    assert minipack.unpackb(big, max_str_len=100) == "x" * 100
    for ext in (msgpack.packb(msgpack.ExtType(1, b"ab")), b"\xc1"):
        with pytest.raises(ValueError):
            minipack.unpackb(ext, **LIMITS)
        with pytest.raises(Exception):  # noqa: B017 (msgpack's own type, whichever)
            msgpack.unpackb(ext, **LIMITS)
    deep = b"\x91" * minipack.MAX_DEPTH + b"\x00"
    assert msgpack.unpackb(minipack.packb(minipack.unpackb(deep))) == msgpack.unpackb(deep)
    with pytest.raises(ValueError):  # not a RecursionError, whatever the depth
        minipack.unpackb(b"\x91" * 5000 + b"\x00")
    nested: Any = 0
    for _ in range(5000):
        nested = [nested]
    with pytest.raises(ValueError):
        minipack.packb(nested)


def test_protocol_frames_through_either_codec() -> None:
    """What the command line sends and reads, through protocol.py with each codec."""
    req = protocol.Request(id=7, kind="submit", args={"command": ["true"], "env": {"A": "é"}})
    reply = protocol.ok(7, {"job": 12, "cpus": [0, 1], "ok": None, "t": 1.5})
    saved = protocol.codec
    try:
        frames = []
        for codec in (msgpack, minipack):
            protocol.codec = codec
            frames.append((protocol.encode_request(req), protocol.encode_reply(reply)))
            assert protocol.decode_reply(frames[-1][1]) == reply
            assert protocol.decode_request(frames[-1][0]) == req
        assert frames[0] == frames[1]
        with pytest.raises(protocol.DecodeError):
            protocol.decode_reply(b"\xc1")
    finally:
        protocol.codec = saved
