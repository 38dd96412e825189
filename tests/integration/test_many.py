"""Many short jobs submitted back to back through the CLI all run, and free what they held."""

from __future__ import annotations

import json
from typing import Any

from tests.helpers import Node, poll_until

N_JOBS = 50
FINAL = ("completed", "failed", "cancelled", "lost")


def test_fifty_true_jobs_complete_and_free_their_cpus(node: Node) -> None:
    node.start()
    ids = [node.submit("true") for _ in range(N_JOBS)]
    assert len(set(ids)) == N_JOBS
    assert ids == sorted(ids)

    def all_ended() -> list[dict[str, Any]] | None:
        jobs: list[dict[str, Any]] = json.loads(node.ok("list", "--json"))
        mine = [j for j in jobs if j["id"] in ids]
        return mine if len(mine) == N_JOBS and all(j["state"] in FINAL for j in mine) else None
    jobs = poll_until(all_ended, 120, f"all {N_JOBS} jobs to end", interval=0.5)

    bad = [(j["id"], j["state"], j["exit_code"], j["reason"]) for j in jobs
           if (j["state"], j["exit_code"], j["signal"]) != ("completed", 0, None)]
    assert not bad, f"jobs that did not complete cleanly: {bad}\n{node.logs()}"
    assert all(j["attempt"] == 1 for j in jobs)

    st = node.status()
    assert st["cpus"] == {"total": 4, "allocated": 0}
    assert st["jobs"].get("completed") == N_JOBS
    assert not st["jobs"].get("pending") and not st["jobs"].get("running")
    # every supervisor was acknowledged and removed its run directory
    poll_until(lambda: not node.layout.run_dirs(), 30, "every run directory to be removed")
