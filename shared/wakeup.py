"""A thread's way to wake an event loop (I/O): a socketpair whose reading end the loop polls.

The agent's worker and sync threads and the supervisor's ``/proc`` scans hand their results to
the loop the same way: store them, then ``kick()``; the loop polls ``fileno()`` and ``drain()``s
before it takes what was stored (a kick that lands after the drain wakes it again, so nothing
is missed). Both ends are non-blocking: a full buffer already means "wake up".
"""

from __future__ import annotations

import contextlib
import socket


class Wakeup:
    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    def fileno(self) -> int:
        return self._r.fileno()

    def kick(self) -> None:
        """From any thread. A closed or full pair is fine: the loop is going or already woken."""
        with contextlib.suppress(OSError):
            self._w.send(b"x")

    def drain(self) -> None:
        """On the loop, before taking what the kicks announced."""
        with contextlib.suppress(BlockingIOError):
            while self._r.recv(4096):
                pass

    def close(self) -> None:
        self._r.close()
        self._w.close()
