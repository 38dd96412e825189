"""Text from jobs and peers made safe to print or log. Pure.

Anything a job or a peer controls (names, commands, process titles, reasons, bad requests) may
hold terminal escape sequences; printed raw on an operator's terminal they can rewrite the
screen, retitle the window or worse. ``printable`` escapes every control character, and the
invisible characters that reorder or hide text (bidirectional overrides and isolates, zero-width
characters, line and paragraph separators: "Trojan Source"), so that what is shown is what the
text holds.
"""

from __future__ import annotations

#: C0 controls, DEL and C1 controls (ESC, CSI as U+009B, ...), each to its escape. A table for
#: str.translate rather than a regular expression: ``re`` (and the ``enum`` it imports) costs
#: every CLI run that prints a job's text ~3 ms.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
#: the format characters that move or hide what follows them, as ``\\uNNNN``: the Arabic
#: letter mark, the zero-width space, the left-to-right and right-to-left marks, the line and
#: paragraph separators, the embeddings and overrides, the word joiner and invisible operators,
#: the isolates, the byte order mark and the interlinear annotation marks (not the zero-width
#: joiner and non-joiner: scripts and emoji need them, and they move nothing)
_ESCAPES.update({c: f"\\u{c:04x}" for c in (
    0x061C, 0x200B, 0x200E, 0x200F, *range(0x2028, 0x202F), *range(0x2060, 0x2065),
    *range(0x2066, 0x206A), 0xFEFF, *range(0xFFF9, 0xFFFC))})


def printable(text: object) -> str:
    """``text`` with every control character shown as ``\\xNN`` (a tab and newline too) and
    every invisible character that reorders or hides text as ``\\uNNNN``."""
    return str(text).translate(_ESCAPES)


def clip(text: object, limit: int = 200) -> str:
    """At most ``limit`` characters of ``text``, printable, marked when cut."""
    s = str(text)
    cut = len(s) > limit
    s = printable(s[:limit])[:limit]
    return s + "..." if cut else s
