"""Filling the template's partly used pymalloc pools before it forks (memory).

CPython's small-object allocator (pymalloc) serves each request of up to 512 bytes from a pool
of blocks of one size class, and it takes the block from a pool that is already partly used
before it starts a new one. After the template's imports, every size class has such pools,
spread over its ~20 one-MiB arenas, each with a few free blocks. A forked supervisor's first
allocations of each size land in those holes, and each one writes to a page it shares with the
template: a page copied for one small object (and the pool's header page with it).

So the template, just before it freezes, allocates objects of each size class until no partly
used pool has a free block left, and keeps them for good. A supervisor's allocations then start
new pools, on pages of its own, packed together. What the fillers cost is memory of the
template's, shared by none and counted once: ~0.2-0.5 MiB.

How much of each class is free is read from ``sys._debugmallocstats()`` (it writes to the C
stderr, so fd 2 is pointed at a memfd around it). The objects: ``object()`` (16
bytes), ints of one or two 30-bit digits (28 and 32 bytes: class 32), and ``bytes`` of
``size - 33`` bytes for every larger class (a bytes object is its 33-byte header and the data).
None of them is tracked by the collector. Nothing is filled on a Python without pymalloc
(``PYTHONMALLOC=malloc``): the statistics then say nothing.
"""

from __future__ import annotations

import os
import re
import sys

#: rounds of (read what is free, fill it): the reading allocates too, and so may open a hole
ROUNDS = 4
_ROW = re.compile(rb"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$", re.M)

#: the fillers, for the life of the template (never freed: a free would reopen the hole)
KEPT: list[object] = []


def free_blocks() -> dict[int, int]:
    """Free blocks in partly used pools, by block size (empty without pymalloc)."""
    fd = os.memfd_create("mallocstats", os.MFD_CLOEXEC)
    try:
        saved = os.dup(2)
        try:
            sys.stderr.flush()
            os.dup2(fd, 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        chunks = []
        os.lseek(fd, 0, os.SEEK_SET)
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        text = b"".join(chunks)
    finally:
        os.close(fd)
    return {int(m.group(2)): int(m.group(5)) for m in _ROW.finditer(text)}


def _filler(size: int, i: int) -> object:
    if size == 16:
        return object()
    if size == 32:
        return (1 << 31) + i  # two digits: 24 + 8 bytes (a fresh object, unlike a small int)
    return bytes(size - 33)


def fill() -> int:
    """Fill every partly used pool; the number of objects it took."""
    made = 0
    for _ in range(ROUNDS):
        free = {size: n for size, n in free_blocks().items() if n}
        if not free:
            break
        for size, n in free.items():
            for i in range(n):
                KEPT.append(_filler(size, i))
            made += n
    return made
