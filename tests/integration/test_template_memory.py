"""What the template does to its memory before it forks, so that supervisors copy less of it:
the allocator's pools filled (supervisor/poolfill.py), the type attribute cache filled with
what supervisors look up (supervisor/typecache.py) and the at-fork hooks emptied
(supervisor/atfork.py). Each probe runs in an interpreter of its own
and fails where the step it checks is left out."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import Node, one_step_record
from tether.supervisor.hotcode_list import LOOKUPS
from tether.supervisor.typecache import RECORD

#: the share of a supervisor's cached lookups the list must name; below it, regenerate the list
#: (``python -m bench.hotcode``)
COVERED = 0.8


def probe(source: str) -> list[str]:
    res = subprocess.run([sys.executable, "-I", "-c", source], capture_output=True, text=True,
                         timeout=60, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


FILL_PROBE = r"""
import tether.supervisor.template  # everything a supervisor loads, as in the template
from tether.supervisor import poolfill

x = bytes(15)  # a 48-byte block, then freed: the hole the next such allocation takes
at = id(x)
del x
y = bytes(15)
assert id(y) == at, "the premise: a freed block is the next one handed out"
del y
made = poolfill.fill()
z = bytes(15)
print(made, id(z) != at, id(z) >> 14 != at >> 14)
"""


def test_filling_leaves_no_hole_for_a_supervisors_first_allocations() -> None:
    made, elsewhere, other_pool = probe(FILL_PROBE)
    assert int(made) > 100  # the imports leave thousands of holes
    assert (elsewhere, other_pool) == ("True", "True")


CACHE_PROBE = r"""
import sys
from tether.supervisor import typecache

class A:
    def warmed(self): pass
    def cold(self): pass

pairs = typecache.prepare([("__main__:A", "warmed"), ("__main__:Gone", "x"), ("nowhere:B", "y")])
assert pairs == [(A, "warmed")], pairs  # what cannot be found is skipped
warmed, cold = sys.intern("warmed"), sys.intern("cold")
sys._clear_type_cache()
assert typecache.warm(pairs) == 1
before = sys.getrefcount(warmed), sys.getrefcount(cold)
a = A()
a.warmed, a.cold  # each looks its name up on A: a miss keeps a reference to the name
print(sys.getrefcount(warmed) - before[0], sys.getrefcount(cold) - before[1])
"""


def test_a_warmed_lookup_writes_nothing_and_a_cold_one_takes_its_name() -> None:
    assert probe(CACHE_PROBE) == ["0", "1"]


def test_the_lookup_list_names_what_a_supervisor_looks_up(node: Node) -> None:
    cached = {tuple(line.split(" ", 1)) for line in one_step_record(node, RECORD, ".lookups")}
    assert ("types:ModuleType", "getpid") in cached  # e.g. os.getpid
    assert len(cached) > 300
    missing = cached - set(LOOKUPS)
    assert len(missing) <= (1 - COVERED) * len(cached), (
        f"{len(missing)} of the {len(cached)} lookups a supervisor left cached are not in "
        f"supervisor/hotcode_list.py: run python -m bench.hotcode ({sorted(missing)[:10]})")
    with open(node.layout.supervisor_log) as f:
        made = re.search(r"(\d+) of (\d+) type lookups made", f.read())
    assert made is not None
    assert int(made.group(1)) >= 0.9 * int(made.group(2)) == 0.9 * len(LOOKUPS), (
        "types in supervisor/hotcode_list.py's LOOKUPS are gone: run python -m bench.hotcode")


ATFORK_PROBE = r"""
import logging, os, random, threading
from tether.supervisor import atfork

os.register_at_fork(after_in_child=lambda: print("ran", flush=True))
lock = threading._active_limbo_lock  # threading's own hook makes a new one in every child
removed = atfork.empty()
os.register_at_fork(after_in_child=lambda: print("later", flush=True))


def child() -> str:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"kept" if threading._active_limbo_lock is lock else b"remade")
        os._exit(0)
    os.close(w)
    got = os.read(r, 16).decode()
    os.close(r)
    os.waitpid(pid, 0)
    return got


print(removed, child(), atfork.empty(), child(), flush=True)
"""


def test_no_at_fork_hook_runs_once_the_lists_are_emptied() -> None:
    """The interpreter's own lists are emptied, not copies: the hooks registered before
    (threading's, logging's, random's, the probe's) no longer run in a child, a hook registered
    afterwards does until the next emptying, and the count says what went."""
    out = probe(ATFORK_PROBE)
    # threading's 1, logging's 3, random's 1, the probe's 1
    first, state1, again, state2 = (w for w in out if w != "later")
    assert int(first) >= 6 and again == "1", out
    assert out.count("ran") == 0 and out.count("later") == 1, out
    assert (state1, state2) == ("kept", "kept"), out


def test_the_template_says_it_emptied_the_hooks(node: Node) -> None:
    node.start()
    node.wait_template()
    with open(node.layout.supervisor_log) as f:
        emptied = re.search(r"(\d+) at-fork hooks emptied", f.read())
    assert emptied is not None and int(emptied.group(1)) >= 4
