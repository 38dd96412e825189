"""A task that dumps core is reported so in the job object (``core_dumped``)."""

from __future__ import annotations

import os
import signal

from tests.helpers import Node

ABORT = "exec python3 -c 'import os; os.abort()'"


def test_core_dumped_is_in_the_job_object(node: Node) -> None:
    node.start()
    dumped = node.submit("sh", "-c", f"ulimit -c unlimited; {ABORT}")
    plain = node.submit("sh", "-c", f"ulimit -c 0; {ABORT}")
    d = node.wait_end(dumped)
    p = node.wait_end(plain)
    assert (d["state"], d["signal"], d["core_dumped"]) == ("failed", signal.SIGABRT, True), d
    assert "core dumped" in d["reason"]
    assert (p["state"], p["signal"], p["core_dumped"]) == ("failed", signal.SIGABRT, False), p
    for name in os.listdir(node.work):  # core_pattern may drop it here; the node dir goes
        if name.startswith("core"):
            os.unlink(os.path.join(node.work, name))
