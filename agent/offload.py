"""Slow calls off the agent's loop: one worker thread, a bounded queue, results back through a
wakeup socket the loop polls (I/O).

What goes here may wait on things no user should be able to stall the node with: the user
database (NSS may be LDAP), and the check that a submitting user can enter the working
directory and write the outputs (a short process run as that user, on file systems that may
hang). The loop hands a call over and goes on; when the call returns, its callback runs on the
loop (``service``), never on the worker. A full queue refuses at once (``Busy``), so a flood of
submissions costs the agent a bounded amount of memory.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from tether.shared.errors import Busy
from tether.shared.wakeup import Wakeup

log = logging.getLogger("tether.agent")

Done = Callable[[Any, BaseException | None], None]


class Offload:
    def __init__(self, maxsize: int = 64) -> None:
        self.queue: queue.Queue[tuple[Callable[[], Any], Done] | None] = queue.Queue(maxsize)
        self.results: collections.deque[tuple[Done, Any, BaseException | None]] = (
            collections.deque())
        self.wakeup = Wakeup()
        self.thread: threading.Thread | None = None

    def fileno(self) -> int:
        return self.wakeup.fileno()

    def submit(self, call: Callable[[], Any], done: Done, what: str) -> None:
        """Run ``call`` on the worker; ``done(result, error)`` runs later on the loop."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="tether-offload",
                                           daemon=True)
            self.thread.start()
        try:
            self.queue.put_nowait((call, done))
        except queue.Full:
            raise Busy(f"the agent is busy with {self.queue.maxsize} other {what}; "
                       "try again") from None

    def aside(self, call: Callable[[], Any], done: Done, name: str) -> None:
        """Run ``call`` on a thread of its own, for a call that may take long and must not hold
        up the queue's (the node's topology at start); ``done`` runs on the loop as above."""
        threading.Thread(target=self._run, args=(call, done), name=name, daemon=True).start()

    def service(self) -> None:
        """Run the callbacks of finished calls (on the loop)."""
        self.wakeup.drain()
        while self.results:
            done, result, error = self.results.popleft()
            try:
                done(result, error)
            except Exception:  # one callback's bug must not stop the others
                log.exception("internal error in a callback of the worker thread")

    def close(self) -> None:
        if self.thread is not None:
            with contextlib.suppress(queue.Full):
                self.queue.put_nowait(None)
        self.wakeup.close()

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            self._run(*item)

    def _run(self, call: Callable[[], Any], done: Done) -> None:
        """On a worker: the call, its result or error handed to the loop, which decides."""
        try:
            self.results.append((done, call(), None))
        except BaseException as exc:
            self.results.append((done, None, exc))
        self.wakeup.kick()
