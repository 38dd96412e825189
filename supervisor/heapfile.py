"""The template's heap as a file, so that a supervisor can give back the copies it no longer needs.

Theory of operation. A supervisor forked from the template shares the template's memory until it
writes to a page; CPython writes to every object it touches (reference counts), so each page a
supervisor touches becomes a private copy, even where the write is undone at once (a count
raised, then lowered). Once a step runs, about a third of an idle supervisor's private pages are
byte for byte the template's again (bench/README.md). The kernel can share such a page again
only if it can tell it from the original, and for anonymous memory it cannot (KSM can, by
scanning, ``agent --ksm``). For a private mapping of a *file* it can: ``MADV_DONTNEED`` on a
private copy drops it, and the next access maps the file's page, shared.

So the template, once it has made everything a supervisor needs and frozen it, turns its heap
and its big anonymous mappings (CPython's allocator arenas) into a private mapping of a sealed
memfd holding the same bytes (``snapshot``; ``_heapfile.c`` does it in C, where nothing can
write between a range's copy and its replacement). Pages it never touched stay holes in the file
(zeros, as untouched memory reads), and the file goes on as a hole past its end (a mapping the
allocator grows in place reads zeros there, not SIGBUS). A second, read-only private mapping of
the file (the view) is what copies are compared with. Its supervisors inherit that mapping. Once a
supervisor's step runs (``DELAY`` after the launch; later if another of its threads is running
then), it compares each private copy in those mappings with the file and discards the equal
ones (``give_back``). Nothing changes for the process: a page given back holds the same bytes,
and a later write copies it again.

What is left anonymous: every loaded object's static data, zero-filled part included (the
interpreter's signal handler sets flags there at any time; a library's can share a mapping with
an arena), the template's Python frames and thread descriptor (written while the snapshot runs;
the kernel writes a thread's rseq area at any time), its stack, small mappings.

Since the agent's endpoint is a ZeroMQ ROUTER again (ctl.py), every supervisor runs libzmq's
I/O and reaper threads for its whole life, and they free memory the loop's thread allocated (a
sent message's data, a queue's chunk) on these very pages at any moment: ``give_back`` then
finds another thread and never discards anything (its retries end quietly). The file stays:
it costs nothing more than the anonymous memory it replaced.

What it costs: the memfd holds the template's ~12 MB once, where its anonymous memory used to
(the originals are released); a supervisor's comparison is ~1 ms of CPU, once. Where the
extension is missing, or ``snapshot`` fails (the template then logs why), supervisors simply
keep their copies, as before.
"""

from __future__ import annotations

try:
    from tether.supervisor import _heapfile
except ImportError as exc:  # a build without the C extension: supervisors keep their copies
    MISSING: str | None = f"the _heapfile extension is not built ({exc})"
else:
    MISSING = None

#: Anonymous mappings smaller than this stay anonymous (CPython's arenas are 1 MiB; the glibc
#: heap is included whatever its size).
MIN_SIZE = 256 * 1024
#: A supervisor gives back its equal copies this long after its step's launch (before
#: ``agent --ksm`` marks what it still holds, ksm.DELAY).
DELAY = 0.5
#: ... and again after any request that comes after at least this long of quiet (the agent's
#: long poll, renewed every minute, copies ~40 pages it only passes through).
AGAIN_AFTER = 30.0
#: ... and tries again this often while another thread runs (a scan, the output opener).
RETRY = 1.0
#: ... at most this many times.
TRIES = 10


def snapshot() -> str:
    """In the template, once nothing more is made before it serves: the heap becomes the file.
    A line for the template's log, either way."""
    if MISSING is not None:
        return MISSING
    try:
        regions, size = _heapfile.snapshot(MIN_SIZE)
    except (OSError, RuntimeError) as exc:
        return f"the heap stays anonymous: {exc}"
    return f"heap file of {size >> 10} KiB in {regions} mappings"


def inherited() -> bool:
    """Was this process forked from a template whose heap is a file it can compare with?"""
    return MISSING is None and _heapfile.mapped()[1] > 0


def give_back() -> tuple[bool, str] | None:
    """Discard every private copy that still equals the file. None while another thread of
    this process runs; else whether it could, and a line for the log. Never raises: a step's
    supervisor must not end over memory it merely could not give back."""
    try:
        got = _heapfile.give_back()
    except (OSError, RuntimeError) as exc:
        return False, f"cannot give back the copies of the template's pages: {exc}"
    if got is None:
        return None
    return True, (f"gave back {got[0]} of the {got[1]} pages copied from the template: equal "
                  "to it again")
