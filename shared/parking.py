"""Parked requests: a long poll waits here with a deadline until it is answered or expires.

The one helper behind every long poll of the agent (``wait``) and the supervisor (``wait``,
``output`` follows, ``events``). Each parked request is answered exactly once: by whoever takes
it (``take``, ``take_if``) or, when its ``hold`` runs out, by its ``on_expire`` callback; either
way it leaves the lot and its timer is cancelled. A peer whose connection closed is forgotten
(``drop_peer``), so nobody answers into the void or holds memory for it until the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from tether.shared.protocol import RequestId
from tether.shared.timers import Timer, Timers

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@dataclass(eq=False)
class Parked(Generic[T]):
    peer: Any
    rid: RequestId
    value: T
    timer: Timer | None = field(default=None, repr=False)


class Lot(Generic[K, T]):
    def __init__(self, timers: Timers) -> None:
        self.timers = timers
        self._by_key: dict[K, list[Parked[T]]] = {}

    def park(self, key: K, peer: Any, rid: RequestId, hold: float, value: T,
             on_expire: Callable[[Parked[T]], object]) -> Parked[T]:
        """Park a request; ``on_expire(parked)`` answers it if nobody has after ``hold`` s."""
        p: Parked[T] = Parked(peer, rid, value)

        def expire() -> None:
            if self._remove(key, p):
                on_expire(p)
        p.timer = self.timers.at(time.monotonic() + hold, expire)
        self._by_key.setdefault(key, []).append(p)
        return p

    def take(self, key: K) -> list[Parked[T]]:
        """Every request parked under ``key``, removed, their timers cancelled."""
        found = self._by_key.pop(key, [])
        for p in found:
            if p.timer is not None:
                p.timer.cancel()
        return found

    def take_if(self, key: K, pred: Callable[[Parked[T]], bool]) -> list[Parked[T]]:
        """The requests under ``key`` for which ``pred`` holds, removed (the rest stay)."""
        keep: list[Parked[T]] = []
        found: list[Parked[T]] = []
        for p in self._by_key.get(key, []):
            (found if pred(p) else keep).append(p)
        if keep:
            self._by_key[key] = keep
        else:
            self._by_key.pop(key, None)
        for p in found:
            if p.timer is not None:
                p.timer.cancel()
        return found

    def drop_peer(self, peer_key: Hashable) -> int:
        """Forget every request of the peer whose ``key`` is ``peer_key`` (it went away)."""
        dropped = 0
        for key in list(self._by_key):
            dropped += len(self.take_if(key, lambda p: p.peer.key == peer_key))
        return dropped

    def parked(self, key: K) -> list[Parked[T]]:
        return list(self._by_key.get(key, []))

    def __iter__(self) -> Iterator[Parked[T]]:
        for entries in list(self._by_key.values()):
            yield from entries

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_key.values())

    def _remove(self, key: K, p: Parked[T]) -> bool:
        entries = self._by_key.get(key)
        if entries is None or p not in entries:
            return False
        entries.remove(p)
        if not entries:
            del self._by_key[key]
        return True
