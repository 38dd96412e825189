"""Output file names as Slurm writes them: ``%j %x %u %A %a %t %N %%``. Pure: no I/O.

``%j`` job id, ``%x`` job name, ``%u`` user, ``%A`` the array's id (else the job id), ``%a`` the
array index (else 0), ``%t`` the task's rank, ``%N`` the node, ``%%`` a ``%``. A number between
``%`` and the letter zero-pads the value (``%4j``: ``0042``). Any other ``%`` is kept as it is.

Two passes. The agent expands the job's tokens when the job is submitted (``for_job``) and
records the result as the job's ``output``/``error``; ``%t`` and ``%%`` stay in it, and a
``%`` in an expanded value is written ``%%``, so the record is unambiguous. Each task's file is
then ``for_task(recorded, rank)``: a name with a ``%t`` (``per_task``) gives each task its own
files, opened by the supervisor.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r"%(\d{0,3})([jxuAatN%])")


def per_task(recorded: str) -> bool:
    """Does the name give each task its own file (a real ``%t``, not ``%%t``)?"""
    return any(m.group(2) == "t" for m in _TOKEN.finditer(recorded))


def for_job(pattern: str, values: dict[str, str]) -> str:
    """Expand the job's tokens (``values`` keys ``j x u A a N``), keeping ``%t`` and ``%%``, and
    any token ``values`` lacks (a cluster's job learns its ``%N`` only when a node claims it)."""
    def sub(m: re.Match[str]) -> str:
        width, key = m.group(1), m.group(2)
        if key in ("t", "%") or key not in values:
            return m.group(0)
        value = values[key].zfill(int(width)) if width else values[key]
        return value.replace("%", "%%")
    return _TOKEN.sub(sub, pattern)


def for_task(recorded: str, rank: int) -> str:
    """The file task ``rank`` writes: ``%t`` is the rank, ``%%`` a ``%``."""
    def sub(m: re.Match[str]) -> str:
        width, key = m.group(1), m.group(2)
        if key == "%":
            return "%"
        if key == "t":
            return str(rank).zfill(int(width)) if width else str(rank)
        return m.group(0)
    return _TOKEN.sub(sub, recorded)
