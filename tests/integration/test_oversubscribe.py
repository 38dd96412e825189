"""Honest resources (issue 13, friction 7): ``agent --cpus`` beyond the CPUs the agent may run
on is refused unless ``--oversubscribe``, which maps the logical ids onto the real ones and
says so."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from tests.helpers import CLI, Node


def test_more_cpus_than_the_machine_is_refused_in_one_line(make_node: Any) -> None:
    node: Node = make_node()
    real = sorted(os.sched_getaffinity(0))
    res = subprocess.run([*CLI, "agent", "--state-dir", node.state, "--cpus",
                          str(len(real) + 1)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert res.stderr.splitlines() == [
        f"tether: agent: --cpus {len(real) + 1} is more than the {len(real)} CPUs this process "
        f"may run on ({','.join(map(str, real))}); add --oversubscribe to share them out"]
    assert not os.path.exists(node.layout.sock)


def test_oversubscribed_ids_are_logical_affinity_real_and_status_says_so(
        make_node: Any) -> None:
    real = sorted(os.sched_getaffinity(0))
    logical = len(real) + 2
    node: Node = make_node(cpus=logical)
    assert "--oversubscribe" in node.args
    node.start()
    st = node.status()
    assert st["oversubscribed"] == {"logical": logical, "real": real}
    assert f"oversubscribed: {logical} logical CPUs on {len(real)} real" in node.ok("status")
    job = node.submit("sh", "-c", "echo $TETHER_CPUS; grep Cpus_allowed_list /proc/self/status",
                      opts=("--cpus", str(logical)))
    assert node.wait_end(job)["state"] == "completed"
    with open(os.path.join(node.work, f"tether-{st['node']}-{job}.out")) as f:
        ids, allowed = f.read().splitlines()
    assert ids == ",".join(str(c) for c in range(logical))  # what the job was given
    assert _cpu_list(allowed.split()[-1]) == real  # where it may run: the real CPUs
    # a node that fits the machine says nothing of the kind
    plain: Node = make_node(cpus=1)
    assert "--oversubscribe" not in plain.args
    plain.start()
    assert "oversubscribed" not in json.loads(plain.ok("status", "--json"))


def _cpu_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out
