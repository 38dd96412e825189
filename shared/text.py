"""Text from jobs and peers made safe to print or log. Pure.

Anything a job or a peer controls (names, commands, process titles, reasons, bad requests) may
hold terminal escape sequences; printed raw on an operator's terminal they can rewrite the
screen, retitle the window or worse. ``printable`` escapes every control character.
"""

from __future__ import annotations

import re

#: C0 controls, DEL and C1 controls (ESC, CSI as U+009B, ...)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: object) -> str:
    """``text`` with every control character shown as ``\\xNN`` (a tab and newline too)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


def clip(text: object, limit: int = 200) -> str:
    """At most ``limit`` characters of ``text``, printable, marked when cut."""
    s = str(text)
    cut = len(s) > limit
    s = printable(s[:limit])[:limit]
    return s + "..." if cut else s
