"""Time for the poll loops: a heap of one-shot timers (the caller passes the time) and RFC 3339."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tether.shared import stamps


@dataclass(order=True)
class Timer:
    when: float
    seq: int
    callback: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class Timers:
    def __init__(self) -> None:
        self._heap: list[Timer] = []
        self._seq = itertools.count()

    def at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(when, next(self._seq), callback)
        heapq.heappush(self._heap, timer)
        return timer

    def timeout_ms(self, now: float, cap_ms: int | None = None) -> int | None:
        """Milliseconds until the next live timer (None: block), at most ``cap_ms``."""
        while self._heap and self._heap[0].cancelled:
            heapq.heappop(self._heap)
        if not self._heap:
            return cap_ms
        ms = max(0, int((self._heap[0].when - now) * 1000) + 1)
        return ms if cap_ms is None else min(ms, cap_ms)

    def run_due(self, now: float) -> None:
        while self._heap and (self._heap[0].cancelled or self._heap[0].when <= now):
            timer = heapq.heappop(self._heap)
            if not timer.cancelled:
                timer.callback()


def rfc3339_now() -> str:
    """The wall-clock time as RFC 3339 in UTC with milliseconds, e.g. 2026-11-30T05:01:02.345Z."""
    return stamps.stamp(time.time())
