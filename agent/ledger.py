"""The resource ledger: exact CPU and GPU ids and megabytes of memory. Pure.

CPU ids are logical: 0..N-1 with ``--cpus N`` (N may exceed the machine, to model a bigger node),
else the ids this process may run on. ``physical()`` maps a logical id onto a CPU the agent may
use, for affinity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class Conflict(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Allocation:
    cpus: tuple[int, ...]
    gpus: tuple[int, ...]
    memory_mb: int


@dataclass(frozen=True, slots=True)
class Request:
    cpus: int  # total, ntasks x cpus per task
    gpus: int
    memory_mb: int


class Ledger:
    def __init__(self, cpu_ids: list[int], gpus: int, memory_mb: int,
                 allowed: list[int] | None = None) -> None:
        self.cpu_ids = sorted(cpu_ids)
        self.gpu_ids = list(range(gpus))
        self.memory_mb = memory_mb
        self.allowed = sorted(allowed) if allowed else list(self.cpu_ids)
        self.identity = set(self.cpu_ids) <= set(self.allowed)
        self.position = {c: i for i, c in enumerate(self.cpu_ids)}
        self.free_cpus = set(self.cpu_ids)
        self.free_gpus = set(self.gpu_ids)
        self.free_memory = memory_mb
        #: ids running steps hold that this node no longer has (see ``adopt``)
        self.beyond_cpus: set[int] = set()
        self.beyond_gpus: set[int] = set()

    def never_fits(self, req: Request) -> str | None:
        """Why ``req`` could not run even on an empty node, or None."""
        if req.cpus > len(self.cpu_ids):
            return f"needs {req.cpus} CPUs but this node has {len(self.cpu_ids)}"
        if req.gpus > len(self.gpu_ids):
            return f"needs {req.gpus} GPUs but this node has {len(self.gpu_ids)}"
        if req.memory_mb > self.memory_mb:
            return f"needs {req.memory_mb} MB of memory but this node has {self.memory_mb} MB"
        return None

    def fits(self, req: Request) -> bool:
        return (req.cpus <= len(self.free_cpus) and req.gpus <= len(self.free_gpus)
                and req.memory_mb <= self.free_memory)

    def allocate(self, req: Request) -> Allocation | None:
        """The lowest free ids that satisfy ``req``, taken; or None if they are not free now."""
        if not self.fits(req):
            return None
        alloc = Allocation(tuple(sorted(self.free_cpus)[:req.cpus]),
                           tuple(sorted(self.free_gpus)[:req.gpus]), req.memory_mb)
        self.restore(alloc)
        return alloc

    def restore(self, alloc: Allocation) -> None:
        """Take exactly these ids, all or nothing; Conflict if any is unknown or taken."""
        bad_cpus = set(alloc.cpus) - self.free_cpus
        bad_gpus = set(alloc.gpus) - self.free_gpus
        if bad_cpus or bad_gpus or alloc.memory_mb > self.free_memory:
            raise Conflict(
                f"CPUs {sorted(bad_cpus)} / GPUs {sorted(bad_gpus)} are not free or unknown, "
                f"or {alloc.memory_mb} MB exceeds the {self.free_memory} MB free")
        self.free_cpus -= set(alloc.cpus)
        self.free_gpus -= set(alloc.gpus)
        self.free_memory -= alloc.memory_mb

    def adopt(self, alloc: Allocation) -> None:
        """At reattach: take a running step's exact ids back, all or nothing.

        Ids beyond this node (it was restarted smaller: fewer ``--cpus``, ``--gpus`` or less
        memory) stay the step's: they are counted in ``beyond`` until it ends, and memory may
        go below zero free, so no new work is given what a running step still uses. Only an id
        that another running step already holds is a Conflict.
        """
        cpus, gpus = set(alloc.cpus), set(alloc.gpus)
        known_cpus, known_gpus = cpus & set(self.cpu_ids), gpus & set(self.gpu_ids)
        taken = ((known_cpus - self.free_cpus) | (cpus - known_cpus) & self.beyond_cpus,
                 (known_gpus - self.free_gpus) | (gpus - known_gpus) & self.beyond_gpus)
        if taken[0] or taken[1]:
            raise Conflict(f"CPUs {sorted(taken[0])} / GPUs {sorted(taken[1])} are held by "
                           f"another running step")
        self.free_cpus -= known_cpus
        self.free_gpus -= known_gpus
        self.beyond_cpus |= cpus - known_cpus
        self.beyond_gpus |= gpus - known_gpus
        self.free_memory -= alloc.memory_mb

    def release(self, alloc: Allocation) -> None:
        self.beyond_cpus -= set(alloc.cpus)
        self.beyond_gpus -= set(alloc.gpus)
        self.free_cpus |= set(alloc.cpus) & set(self.cpu_ids)
        self.free_gpus |= set(alloc.gpus) & set(self.gpu_ids)
        self.free_memory = min(self.memory_mb, self.free_memory + alloc.memory_mb)

    @property
    def oversubscribed(self) -> bool:
        """More logical CPU ids than CPUs to run them on (``agent --oversubscribe``)."""
        return len(self.cpu_ids) > len(self.allowed)

    def physical(self, cpu: int) -> int:
        """The real CPU a logical id runs on: itself when every id is one this process may
        run on, else the allowed CPUs in turn (a bijection unless oversubscribed)."""
        if self.identity:
            return cpu
        return self.allowed[self.position.get(cpu, cpu) % len(self.allowed)]

    def usage(self) -> dict[str, dict[str, Any]]:
        return {
            "cpus": {"total": len(self.cpu_ids),
                     "allocated": len(self.cpu_ids) - len(self.free_cpus)},
            "gpus": {"total": len(self.gpu_ids),
                     "allocated": len(self.gpu_ids) - len(self.free_gpus)},
            "memory_mb": {"total": self.memory_mb,
                          "allocated": self.memory_mb - self.free_memory},
            # held by running steps beyond what this node has now (restarted smaller)
            "beyond_node": {"cpus": sorted(self.beyond_cpus), "gpus": sorted(self.beyond_gpus),
                            "memory_mb": max(0, -self.free_memory)},
        }
