"""The warm supervisor template's loop, and when it leaves: asked to (``exit`` by an agent of
other code, ``stop`` by one stopped for good), when its socket is no longer its own (the state
directory was removed), or when no agent has held the state directory's lock for the linger its
agent gave it (``agent --template-linger``).

The template outlives agent restarts by design (a new agent of the same code keeps it), so an
agent that stops does not take it along; but one stopped for good (no agent for the linger)
would leave it forever. Whether an agent runs is read from ``/proc/locks``, where the kernel
lists every flock with its file's inode: the lock on ``agent.lock`` is the one thing that says
an agent lives (its pid in the file may be reused, its socket file outlives a SIGKILL). Taking
the lock to test it would be wrong: an agent starting at that instant would find it taken and
refuse to start. Where ``/proc/locks`` cannot be read the template cannot tell, and stays.

Checked when the template is idle (its ``accept`` timed out): a template that is being asked to
spawn supervisors has an agent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable

log = logging.getLogger("tether.template")

#: How often an idle template checks at most (its socket, and its agent when it watches one).
CHECK_INTERVAL = 30.0
#: ...and at least, so that a short linger (a test's) is kept to within a quarter of itself.
MIN_INTERVAL = 0.1

PROC_LOCKS = "/proc/locks"


def still_ours(path: str, inode: int) -> bool:
    """Does ``path`` still name the socket the template bound (inode ``inode``)?"""
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


def locked_inodes(text: str) -> set[int]:
    """The inodes of the files ``/proc/locks`` lists a lock (or a waiter) on: each line has a
    ``MAJOR:MINOR:INODE`` field (``1: FLOCK  ADVISORY  WRITE 123 fd:01:4242 0 EOF``)."""
    found = set()
    for line in text.splitlines():
        for field in line.split():
            parts = field.split(":")
            if len(parts) == 3 and parts[2].isdigit():
                found.add(int(parts[2]))
                break
    return found


class AgentWatch:
    """The agent the template serves, seen through its lock; ``gone()`` once it has been away
    for the linger. Without a lock path (a template started by hand, or by an agent before
    this) it never says so."""

    def __init__(self, lock: str | None = None, linger: float | None = None) -> None:
        self.lock: str | None = None
        self.linger: float | None = None
        #: when the template first saw no agent (monotonic), None while one runs
        self.away_since: float | None = None
        #: why the lock cannot be read, said once in the log
        self.blind: str | None = None
        self.configure(lock, linger)

    def configure(self, lock: str | None, linger: float | None) -> None:
        """Set by the command line, then by each agent's hello (a kept template takes the
        linger of the agent that keeps it)."""
        if isinstance(lock, str) and os.path.isabs(lock):
            self.lock = lock
        if isinstance(linger, (int, float)) and not isinstance(linger, bool) and linger > 0:
            self.linger = float(linger)
        self.away_since = None  # an agent just spoke

    def interval(self) -> float:
        if self.lock is None or self.linger is None:
            return CHECK_INTERVAL
        return max(MIN_INTERVAL, min(CHECK_INTERVAL, self.linger / 4))

    def agent_runs(self) -> bool | None:
        """Does a process hold a lock on the agent's lock file? None: cannot tell."""
        assert self.lock is not None
        try:
            inode = os.stat(self.lock).st_ino
            with open(PROC_LOCKS) as f:
                text = f.read()
        except FileNotFoundError:
            return False  # no lock file: no agent (a state directory being removed)
        except OSError as exc:
            self.blind = str(exc)
            return None
        return inode in locked_inodes(text)

    def gone(self, now: float | None = None) -> bool:
        """Has no agent held the lock for the whole linger?"""
        if self.lock is None or self.linger is None:
            return False
        now = time.monotonic() if now is None else now
        runs = self.agent_runs()
        if runs is None or runs:
            self.away_since = None
            return False
        if self.away_since is None:
            self.away_since = now
        return now - self.away_since >= self.linger


def serve_until_leaving(sock: socket.socket, path: str, inode: int, watch: AgentWatch,
                        serve: Callable[[socket.socket], str]) -> int:
    """Accept and ``serve`` one request at a time (a burst queues in the backlog, answered in
    order) until the template leaves; its exit status."""
    while True:
        sock.settimeout(watch.interval())
        try:
            conn, _ = sock.accept()
        except TimeoutError:
            if not still_ours(path, inode):
                log.info("%s is no longer this template's socket; exiting", path)
                return 0
            if watch.gone():
                log.info("no agent has run for %gs; exiting", watch.linger)
                return _leave(path, inode)
            if watch.blind is not None:
                log.warning("cannot tell whether an agent runs (%s): staying", watch.blind)
                watch.lock = None  # said once; from now on the template stays
            continue
        try:
            op = serve(conn)
            if op in ("exit", "stop"):
                log.info("asked to leave by %s; exiting", "an agent running other code"
                         if op == "exit" else "its agent, stopped for good")
                return _leave(path, inode)
        except Exception:  # one bad request must not take the template down
            log.exception("internal error while serving a request")
        finally:
            conn.close()


def _leave(path: str, inode: int) -> int:
    with contextlib.suppress(OSError):
        if still_ours(path, inode):
            os.unlink(path)  # the next agent finds no socket, rather than one nobody serves
    return 0
