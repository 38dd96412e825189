"""The agent loop's poller: ``zmq.Poller``'s interface over epoll (I/O).

Why. ``zmq.Poller.poll`` hands every registered socket and fd to ``zmq_poll`` on every call,
which asks each ZeroMQ socket for its events: each turn of the loop cost O(registered), and the
agent registers two per live supervisor (its DEALER and its pidfd). With 300 steps running, a
``true`` job cost the loop ~3 ms of CPU more than on an idle node (1,000 steps: 0.74 ms a turn,
~6 turns a job). Here a turn costs O(ready).

How. Plain fds (the door's epoll, wakeup sockets, pipes, pidfds) are in one level-triggered
epoll. A ZeroMQ socket is watched through its ``ZMQ_FD``, which is not level-triggered on
messages: it becomes readable when the socket's mailbox has commands, and whoever processes
them (``ZMQ_EVENTS``, a send, a receive) resets it, possibly taking a "message arrived" with
it. So (libzmq's documented rule) a socket's ``ZMQ_EVENTS`` is asked after its fd signals,
and also, without waiting for its fd, after it was registered or sent on (``touched``): such a
socket may hold a message whose signal a send already consumed. A receive that ends in EAGAIN
leaves the fd armed for the next message, so a reader that drains its socket (``Link.readable``)
needs nothing more.
"""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import Any

import zmq

POLLIN = zmq.POLLIN


class Poller:
    def __init__(self) -> None:
        self.ep = select.epoll()
        #: what each watched fd stands for (an fd, an object with fileno(), a zmq socket)
        self.items: dict[int, Any] = {}
        #: every registered ZeroMQ socket and its ZMQ_FD
        self.zfds: dict[zmq.Socket[Any], int] = {}
        #: ZeroMQ sockets whose events are to be asked at the next poll, signal or not
        self.check: set[zmq.Socket[Any]] = set()
        #: fds unregistered since the last poll (``stale``)
        self.dropped: set[int] = set()

    def register(self, item: Any, flags: int = POLLIN) -> None:
        """Watch ``item`` for input (``flags`` is accepted for zmq.Poller's sake: input only)."""
        if isinstance(item, zmq.Socket):
            fd = int(item.getsockopt(zmq.FD))
            self.zfds[item] = fd
            self.check.add(item)
        else:
            fd = item if isinstance(item, int) else item.fileno()
        try:
            self.ep.register(fd, select.EPOLLIN)
        except FileExistsError:  # the fd was reused while still registered: it is this now
            self.ep.modify(fd, select.EPOLLIN)
        self.items[fd] = item

    def unregister(self, item: Any) -> None:
        """Stop watching ``item``; KeyError if it is not watched (as zmq.Poller)."""
        if isinstance(item, zmq.Socket):
            fd = self.zfds.pop(item)
            self.check.discard(item)
        else:
            fd = item if isinstance(item, int) else item.fileno()
            if fd not in self.items:
                raise KeyError(item)
        del self.items[fd]
        self.dropped.add(fd)
        try:
            self.ep.unregister(fd)
        except (FileNotFoundError, OSError):  # closed already: the epoll forgot it itself
            pass

    def touched(self, sock: zmq.Socket[Any]) -> None:
        """``sock`` was sent on: ask its events at the next poll (see the module's doc)."""
        if sock in self.zfds:
            self.check.add(sock)

    def stale(self, fd: int) -> bool:
        """Whether ``fd`` was unregistered since the last poll: an event the poll gave for it
        was of what it was then, not of what may have its number now (which, if ready, the
        next poll reports: readiness is level-triggered)."""
        return fd in self.dropped

    def poll(self, timeout_ms: int | None = None, limit: int | None = None,
             urgent: Callable[[Any], bool] = lambda item: False) -> list[tuple[Any, int]]:
        """The items with input, waiting at most ``timeout_ms`` (None: until there is some).

        With ``limit``: the ``urgent`` items with input and at most ``limit`` others, so that
        a turn of the loop stays short when hundreds of supervisors answer at once (a restart
        with 1,000 live steps: one turn took ~400 ms while ``status`` waited). The others are
        left for the next poll: a plain fd is reported again (level-triggered), a ZeroMQ
        socket is asked again whatever its fd says (asking it here may have spent the signal).
        """
        self.dropped.clear()
        ready: list[tuple[Any, int]] = []
        found: set[zmq.Socket[Any]] = set()
        if self.check:
            for sock in self.check:
                if _has_input(sock):
                    ready.append((sock, POLLIN))
                    found.add(sock)
            self.check.clear()
        wait = 0.0 if ready else (-1.0 if timeout_ms is None else timeout_ms / 1000)
        for fd, _ in self.ep.poll(wait):
            item = self.items.get(fd)
            if item is None:
                continue
            if isinstance(item, zmq.Socket):
                if item not in found and _has_input(item):
                    ready.append((item, POLLIN))
                    found.add(item)
            else:
                ready.append((item, POLLIN))
        if limit is None or len(ready) <= limit:
            return ready
        now = [r for r in ready if urgent(r[0])]
        others = [r for r in ready if not urgent(r[0])]
        for item, _ in others[limit:]:
            if isinstance(item, zmq.Socket):
                self.check.add(item)
        return now + others[:limit]

    def close(self) -> None:
        self.ep.close()


def _has_input(sock: zmq.Socket[Any]) -> bool:
    try:
        return bool(int(sock.getsockopt(zmq.EVENTS)) & POLLIN)
    except zmq.ZMQError:  # closed meanwhile: nothing to read
        return False
