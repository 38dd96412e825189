"""What a door lets each person hold and take: the caps (``Limits``) and the per-person
accounting they are checked against. Pure bookkeeping, no socket.

Apart from ``door.py`` because it is the one place that decides how much any user may make a
door hold (connections, unread reply bytes, partial frames, requests in flight, a request rate,
log lines), while the door moves bytes: every cap is checked here, against counts the door
reports here as bytes come and go.

A person is a uid together with its subordinate uids (``/etc/subuid``: shared/subids.py; the
daemon says whose is whose through ``persons``), so that ``newuidmap`` gives nobody more than
one share. Each cap holds per person; the totals (connections, partial frames, unread replies,
requests in flight) are shared fairly: when one is reached, the person holding the most yields
(its oldest idle connection, or its largest partial frame or unread reply, is closed), never
the newcomer, unless the newcomer's own person holds as much. Root and the daemon's own uid
(``privileged``) are not rate-limited, are left out of the totals and have their own, larger
connection cap, so no other user can lock them out.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

from tether.shared.door_conn import Conn

#: Lines a second (and a burst) the door logs about bad requests, whoever sends them.
LOG_RATE = 10.0
LOG_BURST = 20.0


@dataclass(frozen=True, slots=True)
class Limits:
    """The caps. "Per uid" is per person: a uid with its subordinate uids (``persons`` of
    ``Caps``; shared/subids.py). The totals count every person but root and the daemon's own
    uid, and are shared fairly: when one is reached, the person holding the most yields."""

    #: connections one person may hold open (root and the daemon's own uid: ``conns_privileged``)
    conns_per_uid: int = 64
    conns_privileged: int = 256
    conns_total: int = 1024
    #: a connection whose unread replies exceed this is not read from until it reads them
    out_per_conn: int = 1 << 20
    #: the same, summed over one person's connections
    out_per_uid: int = 8 << 20
    #: unread reply bytes of everyone: past it, the largest of the person holding the most is
    #: closed
    out_total: int = 8 << 20
    #: partial frames buffered for one person, summed over its connections
    in_per_uid: int = 4 << 20
    #: the same for everyone: a read past it closes the largest partial frame of the person
    #: holding the most (never the reading connection's own)
    in_total: int = 8 << 20
    #: requests of one connection not yet answered (long polls included)
    inflight_per_conn: int = 32
    #: the same, summed over one person's connections
    inflight_per_uid: int = 256
    #: the same for everyone: past it, the connection with the most of the person holding the
    #: most is closed
    inflight_total: int = 4096
    #: requests per second per person (a token bucket of ``burst``), not for privileged uids
    rate: float = 1000.0
    burst: float = 2000.0


#: what a connection holds of each resource shared fairly (bytes, or requests)
IN, OUT, INFLIGHT = "in", "out", "inflight"


def held_by(conn: Conn, kind: str) -> int:
    if kind == IN:
        return conn.deframer.buffered
    if kind == OUT:
        return conn.out_bytes
    return conn.inflight


class Caps:
    """Each person's connections, unread reply bytes, partial-frame bytes, requests in flight
    and request tokens, and the totals of everyone but the privileged."""

    def __init__(self, limits: Limits, privileged: frozenset[int],
                 persons: Callable[[int], int] | None = None) -> None:
        self.limits = limits
        self.privileged = privileged
        #: the person a uid counts as (its login, for a subordinate uid): set by the daemon
        self.persons = persons
        # A quarter of the open-file limit at most: the daemon's own work needs the rest.
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.conns_total = limits.conns_total if soft == resource.RLIM_INFINITY else min(
            limits.conns_total, max(32, soft // 4))
        #: each person's connections (keyed by person, ``Conn.person``)
        self.by_uid: dict[int, set[Conn]] = {}
        self.out_by_uid: dict[int, int] = {}
        self.in_by_uid: dict[int, int] = {}
        self.inflight_by_uid: dict[int, int] = {}
        self.buckets: dict[int, tuple[float, float]] = {}  # person -> (tokens, when)
        #: everyone's but the privileged: connections, and each kind's sum
        self.conns_open = 0
        self.totals: dict[str, int] = {IN: 0, OUT: 0, INFLIGHT: 0}
        self.held: dict[str, dict[int, int]] = {IN: self.in_by_uid, OUT: self.out_by_uid,
                                                INFLIGHT: self.inflight_by_uid}
        self.caps: dict[str, int] = {IN: limits.in_total, OUT: limits.out_total,
                                     INFLIGHT: limits.inflight_total}

    def person_of(self, uid: int) -> int:
        """The person a connection of ``uid`` counts as (a privileged uid: itself)."""
        if uid in self.privileged or self.persons is None:
            return uid
        return self.persons(uid)

    def who(self, conn: Conn) -> str:
        """``uid N``, and whose subordinate uid it is when it is one."""
        if conn.person == conn.uid:
            return f"uid {conn.uid}"
        owner = f"uid {conn.person}" if conn.person >= 0 else "one owner"
        return f"uid {conn.uid} (a subordinate uid of {owner}, counted as one with it)"

    def over_cap(self, conn: Conn) -> str | None:
        """Why ``conn``, just accepted, may not stay by its person's own cap, or None."""
        held = len(self.by_uid.get(conn.person, ()))
        if conn.privileged:
            if held >= self.limits.conns_privileged:
                return f"uid {conn.uid} holds {held} connections already"
            return None
        if held >= self.limits.conns_per_uid:
            return f"{self.who(conn)} holds {held} connections already (at most " \
                   f"{self.limits.conns_per_uid})"
        return None

    def conn_yielder(self, conn: Conn) -> Conn | None | str:
        """Every connection slot is taken and ``conn`` (not privileged) wants one: the
        connection that yields it (the oldest idle connection of the person holding the most,
        else its newest), or why ``conn`` is refused (its own person holds as many)."""
        mine = len(self.by_uid.get(conn.person, ()))
        top, most = None, mine + 1
        for person, conns in self.by_uid.items():
            if person != conn.person and len(conns) > most and not _privileged(conns):
                top, most = person, len(conns)
        if top is None:
            return (f"{self.conns_open} connections open (at most {self.conns_total}) and "
                    f"{self.who(conn)} holds {mine}, as many as anyone (but one)")
        theirs = self.by_uid[top]
        idle = [c for c in theirs if not (c.inflight or c.out_bytes or c.deframer.buffered)]
        if idle:
            return min(idle, key=lambda c: c.serial)
        return max(theirs, key=lambda c: c.serial)

    def yielder(self, kind: str, reader: Conn | None) -> Conn | None:
        """``kind``'s total is at its cap and ``reader`` needs more: the connection holding the
        most of it of the person holding the most (not ``reader``; the next person's when
        that person has no other), or None when nobody else holds any."""
        held = self.held[kind]
        for person in sorted((p for p in held if p in self.by_uid), key=held.__getitem__,
                             reverse=True):
            best: Conn | None = None
            for c in self.by_uid[person]:
                if c is reader or c.privileged or c.closed:
                    continue
                if held_by(c, kind) > 0 and (best is None or held_by(c, kind) > held_by(
                        best, kind)):
                    best = c
            if best is not None:
                return best
        return None

    def full(self, kind: str, more: int) -> bool:
        """Would ``more`` of ``kind`` take everyone's total past its cap?"""
        return self.totals[kind] + more > self.caps[kind]

    def joined(self, conn: Conn) -> None:
        self.by_uid.setdefault(conn.person, set()).add(conn)
        if not conn.privileged:
            self.conns_open += 1

    def left(self, conn: Conn) -> None:
        """``conn`` is closed: it holds nothing any more."""
        peers = self.by_uid.get(conn.person)
        if peers is not None and conn in peers:
            peers.discard(conn)
            if not peers:
                del self.by_uid[conn.person]
            if not conn.privileged:
                self.conns_open -= 1
        self.account(conn, out=-conn.out_bytes, inn=-conn.deframer.buffered,
                     inflight=-conn.inflight)

    def account(self, conn: Conn, *, out: int = 0, inn: int = 0, inflight: int = 0) -> None:
        for kind, delta in ((OUT, out), (IN, inn), (INFLIGHT, inflight)):
            if not delta:
                continue
            per = self.held[kind]
            left = per.get(conn.person, 0) + delta
            if left > 0:
                per[conn.person] = left
            else:
                per.pop(conn.person, None)
            if not conn.privileged:
                self.totals[kind] += delta

    def may_take(self, conn: Conn) -> bool:
        """May one more request of ``conn`` be taken now (its caps and its person's)?"""
        lim = self.limits
        out = self.out_by_uid.get(conn.person, 0)
        return (not conn.closing and conn.inflight < lim.inflight_per_conn
                and conn.out_bytes <= lim.out_per_conn and out <= lim.out_per_uid
                and (conn.privileged
                     or self.inflight_by_uid.get(conn.person, 0) < lim.inflight_per_uid
                     and not self.starved(out)))

    def starved(self, out: int) -> bool:
        """Everyone's unread replies are past their total and a person holds ``out`` bytes
        of them, its fair share or more: it waits (its replies would only close its own
        largest connection; ``Door`` wakes it when the total falls back)."""
        total = self.totals[OUT]
        return total > self.limits.out_total and out * len(self.out_by_uid) >= total

    def over_in(self, person: int) -> bool:
        """Are ``person``'s partial frames over its cap?"""
        return self.in_by_uid.get(person, 0) > self.limits.in_per_uid

    def may_buffer(self, conn: Conn) -> bool:
        """May more of ``conn``'s frame be read in? Under its person's cap, yes. Over it, only
        for the one connection of that person the door finishes first (``finisher``): its
        frame, once whole and taken, gives the space back, and the others go on (door.py wakes
        them). Pausing them all instead left every frame half-read for good. So a person holds
        at most its cap and one frame (and one read), and only that person waits."""
        return not self.over_in(conn.person) or conn is self.finisher(conn.person)

    def finisher(self, person: int) -> Conn | None:
        """The connection of ``person`` whose frame is read on while the person is over its
        cap: the one holding the most of a frame (the oldest of those), or none while a whole
        frame of the person waits to be taken (taking it gives space back; reading more would
        not)."""
        best: Conn | None = None
        for conn in self.by_uid.get(person, ()):
            if not conn.deframer.buffered or conn.closing:
                continue
            if conn.deframer.wanted() <= 0:
                return None
            if best is None or (conn.deframer.buffered, -conn.serial) > (
                    best.deframer.buffered, -best.serial):
                best = conn
        return best

    def spend(self, conn: Conn) -> float | None:
        """Take one token from the bucket of ``conn``'s person: None, or (it is empty) when
        the next one comes, by ``time.monotonic()``."""
        if conn.privileged:
            return None
        person = conn.person
        lim = self.limits
        now = time.monotonic()
        tokens, when = self.buckets.get(person, (lim.burst, now))
        tokens = min(lim.burst, tokens + (now - when) * lim.rate)
        if tokens >= 1.0:
            self.buckets[person] = (tokens - 1.0, now)
            if len(self.buckets) > 4096:  # forget full buckets of persons long gone
                self.buckets = {u: b for u, b in self.buckets.items() if u in self.by_uid}
            return None
        self.buckets[person] = (tokens, now)
        return now + max(0.01, (1.0 - tokens) / lim.rate)


def _privileged(conns: set[Conn]) -> bool:
    """A privileged uid is a person of its own, alone (``person_of``)."""
    return next(iter(conns)).privileged


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
