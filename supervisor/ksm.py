"""Same-page merging of a forked supervisor's own copies (``agent --ksm``, off by default:
docs/operations.md has the trade-off).

A supervisor forked from the template shares its pages until it writes to them; CPython writes
to every object it touches (reference counts), so a running supervisor holds ~1,000 private
copies, most of them byte-identical to another supervisor's copy of the same page. ksmd merges
identical pages, but only in mappings marked ``MADV_MERGEABLE``, and it reads every marked page
once per pass: marking the template's whole writable memory (inherited by its forks) made ksmd
read ~3,800 pages per supervisor, ~2,800 of them still shared with the template and nothing to
gain, so that at the kernel's default speed (100 pages every 20 ms) a pass over 100 supervisors
took over a minute and merging was complete only after ~3 minutes.

So the template marks nothing, and each supervisor, once its step is running and the start-up's
copies are made, marks only the pages it holds alone: ``/proc/self/pagemap`` says which pages
of its private writable mappings are present and mapped exclusively (bit 56: a copy, or memory
of its own), and this marks those runs, joined across small gaps so that the mappings are not
split into thousands of pieces (each piece is a kernel ``vm_area_struct``). The mark stays with
this process: its tasks were forked before it, and a mark on a mapping ends with exec anyway.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct

log = logging.getLogger("tether.supervisor")

#: set by the template (``--ksm``) before it forks: its supervisors mark their copies
ENABLED = False
#: how long after the launch: the claim's reply, the agent's first requests and the loop's
#: first turns have made their copies by then
DELAY = 1.0
#: runs of exclusive pages closer than this (in pages) are marked as one: fewer mappings, and
#: a few shared pages for ksmd to read in between
JOIN_GAP = 2

MADV_MERGEABLE = 12
PAGE = os.sysconf("SC_PAGE_SIZE")
PRESENT = 1 << 63
EXCLUSIVE = 1 << 56

_libc = ctypes.CDLL(None, use_errno=True)  # libc's symbols, as the interpreter links them
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def private_writable_mappings(maps: str) -> list[tuple[int, int]]:
    """The (start, end) of each private writable mapping in a ``/proc/PID/maps`` text."""
    out = []
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) < 2 or fields[1][1] != "w" or fields[1][3] != "p":
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        out.append((lo, hi))
    return out


def exclusive_runs(start: int, entries: bytes, gap: int = JOIN_GAP) -> list[tuple[int, int]]:
    """Runs [lo, hi) of addresses whose pagemap entries (``entries``, 8 bytes a page from
    ``start``) are present and exclusively mapped; runs closer than ``gap`` pages are joined."""
    runs: list[tuple[int, int]] = []
    n = len(entries) // 8
    for i, (e,) in enumerate(struct.iter_unpack("=Q", entries[:n * 8])):
        if e & PRESENT and e & EXCLUSIVE:
            addr = start + i * PAGE
            if runs and addr - runs[-1][1] <= gap * PAGE:
                runs[-1] = (runs[-1][0], addr + PAGE)
            else:
                runs.append((addr, addr + PAGE))
    return runs


def mark_own_copies() -> tuple[int, int, str | None]:
    """madvise(MADV_MERGEABLE) the runs of this process's exclusively mapped pages. Returns
    (pages in the marked runs, runs marked, why one was refused or None)."""
    with open("/proc/self/maps") as f:
        mappings = private_writable_mappings(f.read())  # whole, before madvise splits any
    pages = marked = 0
    why = None
    fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    try:
        for lo, hi in mappings:
            entries = os.pread(fd, (hi - lo) // PAGE * 8, lo // PAGE * 8)
            for a, b in exclusive_runs(lo, entries):
                if _libc.madvise(a, b - a, MADV_MERGEABLE) == 0:
                    pages += (b - a) // PAGE
                    marked += 1
                else:
                    why = os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)
    return pages, marked, why


def mark_now() -> None:
    """The timer's callback: mark, and say what was marked (never fails the step)."""
    try:
        pages, runs, why = mark_own_copies()
    except OSError as exc:
        log.warning("--ksm: cannot read this process's page map: %s", exc)
        return
    if why is not None:
        log.warning("--ksm: madvise(MADV_MERGEABLE) refused (%s); %d pages marked", why, pages)
    else:
        log.info("--ksm: %d pages in %d runs marked mergeable", pages, runs)
