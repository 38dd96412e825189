"""Group commit off the agent's loop: one thread fsyncs the database while the loop goes on (I/O).

Theory of operation. At the end of each turn the loop hands over the turn's held actions (the
replies, spawns and requests that must wait until the turn's commits are durable, group_commit.py
``hold``) as one batch. The thread takes every batch queued so far, makes the database durable
with one fsync (an fsync covers every commit made before it started, so batches queued
meanwhile share it), and hands the batches back, in order, through a wakeup socket the loop
polls; the loop then does the actions. Meanwhile the loop keeps serving: requests that arrive
during an fsync are read, checked and committed, and their own actions wait for the next one.
So a slow disk (an fsync took 15-30 ms on the shared development VM under load) costs each
request one fsync of latency but no longer stops the loop, and the fsyncs per job fall as load
grows. A batch with no commit behind it (an action held only to keep its order) is handed back
after the batches before it, without an fsync of its own.

An fsync that fails is reported to the loop, which stops (crash-only: the kernel may have
dropped the pages, so nothing that waited for it is sent; a restarted agent reads what the disk
really holds).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from tether.shared.wakeup import Wakeup

Action = Callable[[], None]


class Syncer:
    def __init__(self, fsync: Callable[[], None], before: Callable[[bool], None]) -> None:
        """``fsync()`` makes every commit so far durable (called on the thread); ``before(held)``
        is called on the thread just before it, ``held`` saying whether actions wait for it
        (the fault-injection point)."""
        self.fsync = fsync
        self.before = before
        self.cond = threading.Condition()
        self.todo: list[tuple[list[Action], bool]] = []
        self.done: collections.deque[list[Action]] = collections.deque()
        self.error: OSError | None = None
        #: batches handed over and not yet handed back
        self.in_flight = 0
        self.stopping = False
        self.wakeup = Wakeup()
        self.thread: threading.Thread | None = None

    def fileno(self) -> int:
        return self.wakeup.fileno()

    def submit(self, actions: list[Action], sync: bool) -> None:
        """Hand over a batch: its actions come back from ``service`` once an fsync that
        started after this call has returned (``sync``), or after the batches before it."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="tether-sync", daemon=True)
            self.thread.start()
        with self.cond:
            self.todo.append((actions, sync))
            self.in_flight += 1
            self.cond.notify()

    def service(self) -> list[Action]:
        """The actions of every batch made durable since the last call, in order (on the
        loop). Raises the ``OSError`` of a failed fsync."""
        self.wakeup.drain()
        if self.error is not None:
            raise self.error
        out: list[Action] = []
        while self.done:
            out.extend(self.done.popleft())
            self.in_flight -= 1
        return out

    def close(self) -> list[Action]:
        """Stop the thread; return the actions of every batch not handed back yet, in order
        (the caller makes the database durable itself before doing them)."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(10.0)
        out: list[Action] = []
        while self.done:
            out.extend(self.done.popleft())
        with self.cond:
            for actions, _ in self.todo:
                out.extend(actions)
            self.todo.clear()
        self.in_flight = 0
        self.wakeup.close()
        return out

    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.todo and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
                batches, self.todo = self.todo, []
            if any(sync for _, sync in batches):
                try:
                    self.before(any(actions for actions, _ in batches))
                    self.fsync()
                except OSError as exc:
                    self.error = exc
                    batches = []
            self.done.extend(actions for actions, _ in batches)
            self.wakeup.kick()
            if self.error is not None:
                return
