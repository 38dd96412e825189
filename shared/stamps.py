"""The agent's RFC 3339 timestamps (``2026-12-01T06:04:00.123Z``, from ``timers.rfc3339_now``)
read back as epoch seconds, for the scheduler, the CLI and the benchmarks. Pure; it imports
only ``datetime``, so the CLI's lean start keeps it."""

from __future__ import annotations

from datetime import datetime


def epoch(stamp: str | None) -> float | None:
    """Epoch seconds of ``stamp``; None for None, an empty or an unreadable stamp."""
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
