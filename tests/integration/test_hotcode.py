"""The template packs the code supervisors run (supervisor/hotcode.py): the list it packs by
still names what a supervisor runs, and packing moves that code together without changing it."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import Node, one_step_record
from tether.supervisor.hotcode import RECORD
from tether.supervisor.hotcode_list import HOT

#: the share of what a supervisor ran that the list must name; below it, regenerate the list
#: (``python -m bench.hotcode``): supervisors would copy more of the template's memory
COVERED = 0.9


def test_the_list_names_what_a_supervisor_runs(node: Node) -> None:
    ran = one_step_record(node, RECORD, ".calls")
    assert "tether.supervisor.__main__:start" in ran  # from its fork on
    assert "tether.supervisor.reaping:Reaping.reap" in ran  # to its end
    missing = [name for name in ran if name not in set(HOT)]
    assert len(missing) <= (1 - COVERED) * len(ran), (
        f"{len(missing)} of the {len(ran)} functions a supervisor ran are not in "
        f"supervisor/hotcode_list.py: run python -m bench.hotcode ({missing[:10]})")


PACK_PROBE = r"""
import gc, sys, types
import tether.supervisor.template  # everything a supervisor loads, as in the template
from tether.supervisor import hotcode
from tether.supervisor.hotcode_list import HOT

def hot_functions():
    return [f for f in gc.get_objects() if isinstance(f, types.FunctionType)
            and hotcode.key(f.__code__, f.__globals__.get("__name__")) in set(HOT)]

before = {id(f): f.__code__ for f in hot_functions()}
pages_before = {id(c) // 4096 for c in before.values()}
moved = hotcode.pack(HOT)
assert len(hotcode._originals) == moved  # kept: freed, they would leave holes to be filled
after = hot_functions()
assert {id(f) for f in after} == set(before), "functions were replaced, not their code"
assert all(f.__code__ == before[id(f)] and f.__code__ is not before[id(f)] for f in after)
pages_after = {id(f.__code__) // 4096 for f in after}
import json, os.path
assert json.dumps({"a": [1, 2]}, indent=1, sort_keys=True) == '{\n "a": [\n  1,\n  2\n ]\n}'
assert os.path.join("/a", "b") == "/a/b"
print(moved, len(before), len(pages_before), len(pages_after))
"""


def test_packing_moves_the_listed_code_together_and_changes_nothing_else() -> None:
    res = subprocess.run([sys.executable, "-I", "-c", PACK_PROBE], capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    moved, functions, pages_before, pages_after = map(int, res.stdout.split())
    assert moved >= 0.9 * len(HOT), (moved, len(HOT))
    assert functions >= moved * 0.9
    assert pages_after * 2 < pages_before, (pages_before, pages_after)
