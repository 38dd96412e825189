"""What a door lets each uid hold and take: the caps (``Limits``) and the per-uid accounting
they are checked against. Pure bookkeeping, no socket.

Apart from ``door.py`` because it is the one place that decides how much any user may make a
door hold (connections, unread reply bytes, partial frames, requests in flight, a request rate,
log lines), while the door moves bytes: every cap is checked here, against counts the door
reports here as bytes come and go. Root and the daemon's own uid (``privileged``) are not
rate-limited and have their own, larger connection cap, so no other user can lock them out.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass

from tether.shared.door_conn import Conn

#: Lines a second (and a burst) the door logs about bad requests, whoever sends them.
LOG_RATE = 10.0
LOG_BURST = 20.0


@dataclass(frozen=True, slots=True)
class Limits:
    #: connections one uid may hold open (root and the daemon's own uid: ``conns_privileged``)
    conns_per_uid: int = 64
    conns_privileged: int = 256
    conns_total: int = 1024
    #: a connection whose unread replies exceed this is not read from until it reads them
    out_per_conn: int = 1 << 20
    #: the same, summed over one uid's connections
    out_per_uid: int = 8 << 20
    #: partial frames buffered for one uid, summed over its connections
    in_per_uid: int = 4 << 20
    #: requests of one connection not yet answered (long polls included)
    inflight_per_conn: int = 32
    #: requests per second per uid (a token bucket of ``burst``), not for privileged uids
    rate: float = 1000.0
    burst: float = 2000.0


class Caps:
    """Each uid's connections, unread reply bytes, partial-frame bytes and request tokens."""

    def __init__(self, limits: Limits, privileged: frozenset[int]) -> None:
        self.limits = limits
        self.privileged = privileged
        # A quarter of the open-file limit at most: the daemon's own work needs the rest.
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.conns_total = limits.conns_total if soft == resource.RLIM_INFINITY else min(
            limits.conns_total, max(32, soft // 4))
        self.by_uid: dict[int, set[Conn]] = {}
        self.out_by_uid: dict[int, int] = {}
        self.in_by_uid: dict[int, int] = {}
        self.buckets: dict[int, tuple[float, float]] = {}  # uid -> (tokens, when)

    def over_cap(self, uid: int, open_conns: int) -> str | None:
        """Why ``uid`` may not open one more connection (``open_conns`` are open), or None."""
        held = len(self.by_uid.get(uid, ()))
        if uid in self.privileged:
            if held >= self.limits.conns_privileged:
                return f"uid {uid} holds {held} connections already"
            return None
        if held >= self.limits.conns_per_uid:
            return f"uid {uid} holds {held} connections already (at most " \
                   f"{self.limits.conns_per_uid})"
        if open_conns >= self.conns_total:
            return f"{open_conns} connections open (at most {self.conns_total})"
        return None

    def joined(self, conn: Conn) -> None:
        self.by_uid.setdefault(conn.uid, set()).add(conn)

    def left(self, conn: Conn) -> None:
        """``conn`` is closed: it holds nothing any more."""
        peers = self.by_uid.get(conn.uid)
        if peers is not None:
            peers.discard(conn)
            if not peers:
                del self.by_uid[conn.uid]
        self.account(conn.uid, out=-conn.out_bytes, inn=-conn.deframer.buffered)

    def account(self, uid: int, *, out: int = 0, inn: int = 0) -> None:
        if out:
            left = self.out_by_uid.get(uid, 0) + out
            if left > 0:
                self.out_by_uid[uid] = left
            else:
                self.out_by_uid.pop(uid, None)
        if inn:
            left = self.in_by_uid.get(uid, 0) + inn
            if left > 0:
                self.in_by_uid[uid] = left
            else:
                self.in_by_uid.pop(uid, None)

    def may_take(self, conn: Conn) -> bool:
        """May one more request of ``conn`` be taken now (its caps and its uid's)?"""
        lim = self.limits
        return (not conn.closing and conn.inflight < lim.inflight_per_conn
                and conn.out_bytes <= lim.out_per_conn
                and self.out_by_uid.get(conn.uid, 0) <= lim.out_per_uid)

    def over_in(self, uid: int) -> bool:
        """Are ``uid``'s partial frames over its cap?"""
        return self.in_by_uid.get(uid, 0) > self.limits.in_per_uid

    def may_buffer(self, conn: Conn) -> bool:
        """May more of ``conn``'s frame be read in? Under its uid's cap, yes. Over it, only
        for the one connection of that uid the door finishes first (``finisher``): its frame,
        once whole and taken, gives the space back, and the others go on (door.py wakes them).
        Pausing them all instead left every frame half-read for good. So a uid holds at most
        its cap and one frame (and one read per connection), and only that uid waits."""
        return not self.over_in(conn.uid) or conn is self.finisher(conn.uid)

    def finisher(self, uid: int) -> Conn | None:
        """The connection of ``uid`` whose frame is read on while the uid is over its cap:
        the one holding the most of a frame (the oldest of those), or none while a whole frame
        of the uid waits to be taken (taking it gives space back; reading more would not)."""
        best: Conn | None = None
        for conn in self.by_uid.get(uid, ()):
            if not conn.deframer.buffered or conn.closing:
                continue
            if conn.deframer.wanted() <= 0:
                return None
            if best is None or (conn.deframer.buffered, -conn.serial) > (
                    best.deframer.buffered, -best.serial):
                best = conn
        return best

    def spend(self, uid: int) -> float | None:
        """Take one token from the uid's bucket: None, or (it is empty) when the next one
        comes, by ``time.monotonic()``."""
        if uid in self.privileged:
            return None
        lim = self.limits
        now = time.monotonic()
        tokens, when = self.buckets.get(uid, (lim.burst, now))
        tokens = min(lim.burst, tokens + (now - when) * lim.rate)
        if tokens >= 1.0:
            self.buckets[uid] = (tokens - 1.0, now)
            if len(self.buckets) > 4096:  # forget full buckets of uids long gone
                self.buckets = {u: b for u, b in self.buckets.items() if u in self.by_uid}
            return None
        self.buckets[uid] = (tokens, now)
        return now + max(0.01, (1.0 - tokens) / lim.rate)


class LogBudget:
    """The lines a door logs about what peers send: ~10 a second in all, whoever sends them
    (a peer that reconnects for every bad frame gets no more)."""

    def __init__(self) -> None:
        self.bucket = (LOG_BURST, time.monotonic())
        #: lines refused since the last one logged (said with the next one)
        self.dropped = 0

    def take(self, now: float) -> bool:
        tokens, when = self.bucket
        tokens = min(LOG_BURST, tokens + (now - when) * LOG_RATE)
        if tokens < 1.0:
            self.bucket = (tokens, now)
            self.dropped += 1
            return False
        self.bucket = (tokens - 1.0, now)
        return True
