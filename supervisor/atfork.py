"""The interpreter's at-fork hooks, emptied in the template (memory and CPU per supervisor).

``os.register_at_fork`` keeps three lists in the interpreter (before a fork, after it in the
parent, after it in the child), and ``PyOS_BeforeFork`` and ``PyOS_AfterFork_*`` run them
around every fork, the template's clone of each supervisor included. The standard modules a
supervisor imports register five: threading's (in the child: a new lock for its table of
threads, the surviving thread's locks made anew), logging's (before: take the module lock;
after: release it, or in the child make every handler's lock anew) and random's (in the child:
reseed). In a process with one thread, none of them has work to do but random's reseeding,
and the template reseeds each supervisor itself (``template.after_fork``). What they cost is
not their work but that they run for the first time in every forked child: the code, objects
and allocator pools they touch are the template's pages, each copied into the supervisor on
its first write (~140 pages before the supervisor's first line; ~35 of them, and ~45 page
faults, are still saved once its step runs; bench/README.md).

So the template empties the three lists once, before it freezes, and no hook runs around its
forks or its supervisors' own: those (the output opener for another user's job,
``shared.as_owner``) run only system calls in the child before ``_exit``. The C-level part of
the fork protocol (the GIL, the import lock, the thread states, signals) runs as before.
"""

from __future__ import annotations

import gc
import os


def empty() -> int:
    """Empty the interpreter's three at-fork lists; the number of hooks removed, or -1 (and
    nothing changed) where the lists cannot be told apart for certain."""
    # The lists are the interpreter's, out of reach by name: registering a mark of our own
    # in each and finding the one list that ends with it names them.
    marks = (lambda: None, lambda: None, lambda: None)
    os.register_at_fork(before=marks[0], after_in_parent=marks[1], after_in_child=marks[2])
    found: list[list[object]] = []
    referrers = gc.get_referrers(*marks)
    for mark in marks:
        lists = [r for r in referrers if type(r) is list and r and r[-1] is mark]
        if len(lists) == 1:
            found.append(lists[0])
    if len(found) != len(marks):
        for lst in found:
            lst.pop()  # a list not found keeps its mark: a call that does nothing
        return -1
    removed = 0
    for lst in found:
        lst.pop()
        removed += len(lst)
        lst.clear()
    return removed
