"""msgpack for the command line: ``packb`` and ``unpackb`` of what tether's frames hold (None,
booleans, integers, floats, str, bytes, lists, tuples and dicts), in msgpack's own encoding.
Pure: no I/O.

Why. Importing msgpack costs every ``tether`` command ~4.5 ms (its package imports
``datetime``, ``collections`` and its ext types before the C extension), a quarter of what a
short command such as ``inspect --json`` spends beyond the interpreter's start. The command
line's frames are small and come from root's daemons; the agent and the supervisors keep
msgpack itself, which reads what every local user sends, fast and within ``UNPACK_LIMITS``
(protocol.py picks the codec: ``cli/connect.py`` hands it this module).

What it promises, checked against msgpack in ``tests/test_minipack.py`` over random values and
damaged frames: ``packb`` writes exactly what ``msgpack.packb`` writes with its defaults
(``use_bin_type``: str as str, bytes as bin; floats as float64; the shortest integer; tuples as
arrays); ``unpackb`` reads what ``msgpack.unpackb(raw=False)`` reads and refuses what it
refuses under the same limits (ext types: ``max_ext_len`` is 0 in tether), raising
``ValueError`` (msgpack raises a zoo of types; protocol.py turns any into ``DecodeError``).
One difference, both ways: nesting deeper than ``MAX_DEPTH`` is refused.
"""

from __future__ import annotations

from struct import Struct

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    from typing import Any

#: nesting refused beyond this (msgpack allows 1,024 levels; tether's frames nest a few, and
#: this way the reader's recursion stays far from Python's own limit)
MAX_DEPTH = 200
_F64 = Struct(">d")
_F32 = Struct(">f")


def packb(obj: Any) -> bytes:
    out = bytearray()
    _pack(obj, out, MAX_DEPTH)
    return bytes(out)


def _pack(o: Any, out: bytearray, depth: int) -> None:
    if depth < 0:
        raise ValueError("recursion limit exceeded")
    if o is None:
        out.append(0xC0)
    elif o is True:
        out.append(0xC3)
    elif o is False:
        out.append(0xC2)
    elif isinstance(o, int):
        _pack_int(int(o), out)
    elif isinstance(o, float):
        out.append(0xCB)
        out += _F64.pack(o)
    elif isinstance(o, str):
        data = o.encode()
        _header(len(data), out, 0xA0, 32, 0xD9, 0xDA, 0xDB)
        out += data
    elif isinstance(o, bytes | bytearray | memoryview):
        data = bytes(o)
        _header(len(data), out, -1, 0, 0xC4, 0xC5, 0xC6)
        out += data
    elif isinstance(o, list | tuple):
        _header(len(o), out, 0x90, 16, -1, 0xDC, 0xDD)
        for item in o:
            _pack(item, out, depth - 1)
    elif isinstance(o, dict):
        _header(len(o), out, 0x80, 16, -1, 0xDE, 0xDF)
        for key, value in o.items():
            _pack(key, out, depth - 1)
            _pack(value, out, depth - 1)
    else:
        raise TypeError(f"can not serialize {type(o).__name__!r} object")


def _pack_int(n: int, out: bytearray) -> None:
    if 0 <= n < 0x80 or -0x20 <= n < 0:
        out.append(n & 0xFF)
    elif n >= 0:
        for code, size in ((0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8)):
            if n < 1 << (8 * size):
                out.append(code)
                out += n.to_bytes(size, "big")
                return
        raise OverflowError("Integer value out of range")
    else:
        for code, size in ((0xD0, 1), (0xD1, 2), (0xD2, 4), (0xD3, 8)):
            if n >= -(1 << (8 * size - 1)):
                out.append(code)
                out += n.to_bytes(size, "big", signed=True)
                return
        raise OverflowError("Integer value out of range")


def _header(n: int, out: bytearray, fix: int, fix_below: int, c8: int, c16: int,
            c32: int) -> None:
    if n < fix_below:
        out.append(fix | n)
    elif n < 0x100 and c8 >= 0:
        out += bytes((c8, n))
    elif n < 0x10000:
        out.append(c16)
        out += n.to_bytes(2, "big")
    elif n < 0x100000000:
        out.append(c32)
        out += n.to_bytes(4, "big")
    else:
        raise ValueError(f"{n} items or bytes: too many for msgpack")


def unpackb(data: bytes, *, raw: bool = False, strict_map_key: bool = True,
            max_str_len: int = -1, max_bin_len: int = -1, max_array_len: int = -1,
            max_map_len: int = -1, max_ext_len: int = -1) -> Any:
    """As ``msgpack.unpackb`` with ``raw=False`` (the only way tether reads): one object,
    nothing after it; ``max_*`` bound each string, binary, array and map (-1: the frame's
    length, as msgpack's defaults); ext types are refused (tether sends none)."""
    if raw:
        raise ValueError("raw=True is not supported")
    whole = len(data)
    reader = _Reader(memoryview(data), strict_map_key,
                     whole if max_str_len < 0 else max_str_len,
                     whole if max_bin_len < 0 else max_bin_len,
                     whole if max_array_len < 0 else max_array_len,
                     whole // 2 if max_map_len < 0 else max_map_len)
    obj = reader.read(MAX_DEPTH + 1)
    if reader.pos != whole:
        raise ValueError(f"extra data: {whole - reader.pos} bytes after the object")
    return obj


class _Reader:
    __slots__ = ("buf", "pos", "strict", "max_str", "max_bin", "max_array", "max_map")

    def __init__(self, buf: memoryview, strict: bool, max_str: int, max_bin: int,
                 max_array: int, max_map: int) -> None:
        self.buf, self.pos, self.strict = buf, 0, strict
        self.max_str, self.max_bin = max_str, max_bin
        self.max_array, self.max_map = max_array, max_map

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("incomplete frame: it ends inside an object")
        chunk = self.buf[self.pos:end]
        self.pos = end
        return chunk

    def uint(self, size: int) -> int:
        return int.from_bytes(self.take(size), "big")

    def read(self, depth: int) -> Any:
        if depth < 0:
            raise ValueError("nested too deeply")
        b = self.take(1)[0]
        if b < 0x80:
            return b
        if b >= 0xE0:
            return b - 0x100
        if b <= 0x8F:
            return self.map(b & 0x0F, depth)
        if b <= 0x9F:
            return self.array(b & 0x0F, depth)
        if b <= 0xBF:
            return self.str(b & 0x1F)
        if b == 0xC0:
            return None
        if b == 0xC2:
            return False
        if b == 0xC3:
            return True
        if 0xC4 <= b <= 0xC6:
            n = self.uint(1 << (b - 0xC4))
            if n > self.max_bin:
                raise ValueError(f"bin of {n} bytes exceeds max_bin_len ({self.max_bin})")
            return bytes(self.take(n))
        if b == 0xCA:
            return _F32.unpack(self.take(4))[0]
        if b == 0xCB:
            return _F64.unpack(self.take(8))[0]
        if 0xCC <= b <= 0xCF:
            return self.uint(1 << (b - 0xCC))
        if 0xD0 <= b <= 0xD3:
            return int.from_bytes(self.take(1 << (b - 0xD0)), "big", signed=True)
        if 0xD9 <= b <= 0xDB:
            return self.str(self.uint(1 << (b - 0xD9)))
        if b in (0xDC, 0xDD):
            return self.array(self.uint(2 if b == 0xDC else 4), depth)
        if b in (0xDE, 0xDF):
            return self.map(self.uint(2 if b == 0xDE else 4), depth)
        raise ValueError(f"type byte 0x{b:02x} is not read here (ext, or never used)")

    def str(self, n: int) -> str:
        if n > self.max_str:
            raise ValueError(f"str of {n} bytes exceeds max_str_len ({self.max_str})")
        return str(self.take(n), "utf-8")

    def array(self, n: int, depth: int) -> list[Any]:
        if n > self.max_array:
            raise ValueError(f"array of {n} items exceeds max_array_len ({self.max_array})")
        return [self.read(depth - 1) for _ in range(n)]

    def map(self, n: int, depth: int) -> dict[Any, Any]:
        if n > self.max_map:
            raise ValueError(f"map of {n} pairs exceeds max_map_len ({self.max_map})")
        out: dict[Any, Any] = {}
        for _ in range(n):
            key = self.read(depth - 1)
            if self.strict and type(key) not in (str, bytes):
                raise ValueError(f"{type(key).__name__} is not allowed for map key")
            out[key] = self.read(depth - 1)  # (a list as a key: TypeError, as msgpack's)
        return out
