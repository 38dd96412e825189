"""The agent's RFC 3339 timestamps (``2026-12-01T06:04:00.123Z``: UTC, milliseconds): written
from epoch seconds (``stamp``, for the job object's times) and read back as epoch seconds
(``epoch``, for the scheduler, the CLI and the benchmarks). Pure; it imports only ``datetime``,
so the CLI's lean start keeps it."""

from __future__ import annotations

from datetime import UTC, datetime


def stamp(epoch_s: float) -> str:
    """``epoch_s`` (epoch seconds) as RFC 3339 in UTC with milliseconds."""
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def epoch(stamp: str | None) -> float | None:
    """Epoch seconds of ``stamp``; None for None, an empty or an unreadable stamp."""
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
