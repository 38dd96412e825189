"""``json.dumps`` for the replies the CLI prints, without importing ``json``.

``json`` imports ``re`` (and ``re`` imports ``enum``, ``functools`` and ``collections``): ~3 ms,
an eighth of ``tether inspect JOB --json``. A reply decoded from msgpack holds only dicts, lists,
strings, ints, floats, booleans and None, which this writes exactly as ``json.dumps`` with its
defaults does (``ensure_ascii``, ``", "`` and ``": "``, ``NaN``/``Infinity``, non-string keys
as json turns them into strings), strings escaped by the very C function json uses. Anything
else (another type, a subclass, a nesting too deep) goes to ``json.dumps`` itself, so that its
output or its error is json's. ``tests/unit/test_cli_jsonout.py`` compares the two.
"""

from __future__ import annotations

from _json import encode_basestring_ascii as _string  # json's own, in C (CPython's)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


class _Other(Exception):
    """A value of a type this module leaves to json."""


def dumps(value: Any) -> str:
    parts: list[str] = []
    try:
        _encode(value, parts.append)
        return "".join(parts)
    except (_Other, RecursionError):
        pass
    import json

    return json.dumps(value)


def _float(value: float) -> str:
    if value != value:
        return "NaN"
    if value == float("inf"):
        return "Infinity"
    if value == -float("inf"):
        return "-Infinity"
    return float.__repr__(value)


def _key(key: Any) -> str:
    kind = type(key)
    if kind is str:
        return str(key)
    if kind is float:
        return _float(key)
    if key is True:
        return "true"
    if key is False:
        return "false"
    if key is None:
        return "null"
    if kind is int:
        return int.__repr__(key)
    raise _Other


def _encode(value: Any, out: Callable[[str], None]) -> None:
    kind = type(value)
    if kind is str:
        out(_string(value))
    elif value is None:
        out("null")
    elif value is True:
        out("true")
    elif value is False:
        out("false")
    elif kind is int:
        out(int.__repr__(value))
    elif kind is float:
        out(_float(value))
    elif kind is dict:
        out("{")
        first = True
        for key, item in value.items():
            if not first:
                out(", ")
            first = False
            out(_string(_key(key)))
            out(": ")
            _encode(item, out)
        out("}")
    elif kind is list or kind is tuple:
        out("[")
        first = True
        for item in value:
            if not first:
                out(", ")
            first = False
            _encode(item, out)
        out("]")
    else:
        raise _Other
