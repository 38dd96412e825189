"""Fair-share priority: each user's recent usage, and the order it gives pending jobs (Slurm's
``priority/multifactor`` with its fair-share factor alone). Pure.

Usage is allocated CPU-seconds (what a job holds, whether it uses it or not: Slurm's TRES
billing by CPUs), decaying with a half-life (``agent --fairshare-half-life``, Slurm's
``PriorityDecayHalfLife``; default 7 days): a job's CPU-seconds are added when its
allocation is released, and counted as it runs for the jobs holding one now. Every user has an
equal share of the node: a user's fair-share factor is Slurm's classic
``F = 2 ** (-usage_norm / shares_norm)``, with ``usage_norm`` her share of everyone's usage
and ``shares_norm`` one over the number of users with usage or pending jobs; 1 for a user who
used nothing lately, 0.5 when everyone used as much. A pending job's priority is its user's
factor times ``SCALE``, shown as a whole number (``list --format priority``); the queue is
ordered by the factor itself (ties by job id: first come, first served between users who used
the same), each user's own jobs by id.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

#: a factor of 1 is this priority
SCALE = 1_000_000
#: usage below this (CPU-seconds) is forgotten
NEGLIGIBLE = 1e-3
#: the default half-life: Slurm's PriorityDecayHalfLife (7 days)
HALF_LIFE = 7 * 86400.0

User = int | None  # a job's uid; None for jobs recorded before users existed


class Usage:
    """Each user's CPU-seconds, decayed: (value, as of when) per user."""

    def __init__(self, half_life: float = HALF_LIFE) -> None:
        self.half_life = half_life
        self.past: dict[User, tuple[float, float]] = {}

    def value(self, user: User, now: float) -> float:
        value, at = self.past.get(user, (0.0, now))
        if now <= at or self.half_life <= 0:
            return value
        return value * math.pow(2.0, -(now - at) / self.half_life)

    def add(self, user: User, cpu_seconds: float, at: float) -> None:
        """``cpu_seconds`` of ``user`` ended at ``at`` (epoch seconds)."""
        if cpu_seconds <= 0:
            return
        value = self.value(user, at) + cpu_seconds
        self.past[user] = (value, at)

    def now(self, now: float) -> dict[User, float]:
        """Every user's usage as of ``now``; negligible ones are forgotten."""
        out: dict[User, float] = {}
        for user in list(self.past):
            value = self.value(user, now)
            if value < NEGLIGIBLE:
                del self.past[user]
            else:
                out[user] = value
        return out


def factors(usage: Mapping[User, float], users: Iterable[User] = ()) -> dict[User, float]:
    """The fair-share factor of every user in ``usage`` or ``users`` (equal shares)."""
    everyone = set(usage) | set(users)
    total = sum(max(0.0, usage.get(u, 0.0)) for u in everyone)
    if total <= 0:
        return dict.fromkeys(everyone, 1.0)
    n = len(everyone)
    return {u: math.pow(2.0, -n * max(0.0, usage.get(u, 0.0)) / total) for u in everyone}


def priority(factor: float) -> int:
    return round(factor * SCALE)
