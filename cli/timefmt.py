"""Times as people type and read them: RFC 3339 from the agent, local time on screen."""

from __future__ import annotations

import time

from tether.shared import stamps

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


#: an agent's RFC 3339 timestamp (``...Z``) as epoch seconds; None stays None
parse_stamp = stamps.epoch


def local(stamp: float | None) -> str:
    """Local time as Slurm prints it: ``2026-12-01T06:04:00``."""
    if stamp is None:
        return ""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(stamp))


def duration(seconds: float | None) -> str:
    """Slurm's elapsed form: ``M:SS``, ``H:MM:SS``, ``D-HH:MM:SS``."""
    if seconds is None:
        return ""
    s = max(0, int(seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}-{h:02}:{m:02}:{s:02}"
    if h:
        return f"{h}:{m:02}:{s:02}"
    return f"{m}:{s:02}"


def parse_since(text: str, now: float | None = None) -> float:
    """``N[s|m|h|d|w]`` ago (minutes without a unit), ``HH:MM[:SS]`` today, or
    ``YYYY-MM-DD[THH:MM[:SS]]`` local time, as epoch seconds. ValueError names the problem."""
    import re  # only for --since: re (and enum) are ~3 ms of every `list`
    from datetime import datetime

    now = time.time() if now is None else now
    s = text.strip()
    m = re.fullmatch(r"(\d{1,9})([smhdw]?)", s)
    if m:
        return now - int(m.group(1)) * _UNITS[m.group(2) or "m"]
    m = re.fullmatch(r"(\d{1,2}):(\d{2})(?::(\d{2}))?", s)
    if m:
        today = datetime.fromtimestamp(now).replace(hour=0, minute=0, second=0, microsecond=0)
        try:
            at = today.replace(hour=int(m.group(1)), minute=int(m.group(2)),
                               second=int(m.group(3) or 0))
        except ValueError:
            raise ValueError(f"{text!r} is not a time of day") from None
        return at.timestamp()
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}(T\d{1,2}:\d{2}(:\d{2})?)?", s):
        try:
            return datetime.fromisoformat(s).timestamp()
        except ValueError:
            raise ValueError(f"{text!r} is not a date") from None
    raise ValueError(f"{text!r} is not a time: use N[s|m|h|d|w] (ago), HH:MM[:SS] or "
                     "YYYY-MM-DD[THH:MM[:SS]]")
