"""Text from jobs and peers made safe to print or log. Pure.

Anything a job or a peer controls (names, commands, process titles, reasons, bad requests) may
hold terminal escape sequences; printed raw on an operator's terminal they can rewrite the
screen, retitle the window or worse. ``printable`` escapes every control character.
"""

from __future__ import annotations

#: C0 controls, DEL and C1 controls (ESC, CSI as U+009B, ...), each to its escape. A table for
#: str.translate rather than a regular expression: ``re`` (and the ``enum`` it imports) costs
#: every CLI run that prints a job's text ~3 ms.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


def printable(text: object) -> str:
    """``text`` with every control character shown as ``\\xNN`` (a tab and newline too)."""
    return str(text).translate(_ESCAPES)


def clip(text: object, limit: int = 200) -> str:
    """At most ``limit`` characters of ``text``, printable, marked when cut."""
    s = str(text)
    cut = len(s) > limit
    s = printable(s[:limit])[:limit]
    return s + "..." if cut else s
