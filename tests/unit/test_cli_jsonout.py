"""The CLI's own writers give what the standard library's gave: ``jsonout`` json.dumps's text,
``printable`` the regular expression's escapes. Pure: no agent."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from tether.cli.jsonout import dumps
from tether.shared.text import printable


def test_jsonout_writes_what_json_dumps_writes() -> None:
    rng = random.Random(3)
    chars = ["a", "é", "\u2028", "\x00", "\n", '"', "\\", "\ud800", "😀", "\x7f", "/", "\t"]

    def value(depth: int) -> Any:
        kind = rng.randrange(9 if depth < 4 else 6)
        if kind == 0:
            return rng.choice([None, True, False])
        if kind == 1:
            return rng.choice([0, -1, 2**70, -(2**65), 7])
        if kind == 2:
            return rng.choice([0.0, -0.0, 1.5, 1e300, 1e-300, 0.1, float("nan"), float("inf"),
                               -float("inf")])
        if kind in (3, 4, 5):
            return "".join(rng.choice(chars) for _ in range(rng.randrange(6)))
        if kind == 6:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        if kind == 7:
            return tuple(value(depth + 1) for _ in range(rng.randrange(3)))
        return {rng.choice(["k", "é", 1, -2, 2.5, True, False, None, "\x01", float("nan")]):
                value(depth + 1) for _ in range(rng.randrange(4))}
    for _ in range(20000):
        v = value(0)
        assert dumps(v) == json.dumps(v), v


@pytest.mark.parametrize("value", [b"bytes", {1j: 1}, {(1, 2): 3}, object(), {"a": {1, 2}}])
def test_jsonout_leaves_other_types_to_json_and_its_error(value: Any) -> None:
    try:
        want: str | type[BaseException] = json.dumps(value)
    except TypeError:
        want = TypeError
    if want is TypeError:
        with pytest.raises(TypeError):
            dumps(value)
    else:
        assert dumps(value) == want


def test_jsonout_of_subclasses_and_deep_nesting_is_json_s() -> None:
    class Text(str):
        pass

    class Number(int):
        def __repr__(self) -> str:
            return "not a number"

    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    for v in ({"a": Text("b")}, [Number(3)], {Number(4): 1}):
        assert dumps(v) == json.dumps(v)
    with pytest.raises(RecursionError):
        json.dumps(deep)
    with pytest.raises(RecursionError):
        dumps(deep)


def test_printable_escapes_what_the_expression_did() -> None:
    """``printable`` escaped with ``re.sub(r"[\\x00-\\x1f\\x7f-\\x9f]", ...)``; a translate
    table now: every code point gives what it gave, but for the invisible characters that
    reorder or hide text (bidirectional controls, zero-width space, separators...), escaped as
    ``\\uNNNN`` since issue 27."""
    control = re.compile(r"[\x00-\x1f\x7f-\x9f]")
    hidden = re.compile("[\u061c\u200b\u200e\u200f\u2028-\u202e\u2060-\u2064\u2066-\u2069"
                        "\ufeff\ufff9-\ufffb]")
    text = "".join(chr(c) for c in range(0x110000))
    want = hidden.sub(lambda m: f"\\u{ord(m.group()):04x}",
                      control.sub(lambda m: f"\\x{ord(m.group()):02x}", text))
    assert printable(text) == want
    assert printable(42) == "42"
    assert printable("rm \u202efdp.exe") == "rm \\u202efdp.exe"
