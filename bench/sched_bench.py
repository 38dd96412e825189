"""What one pass of the agent's scheduler costs (issue 13): reading the queue from a real
database (``Store.queue``, the agent's window of 100 jobs that could start) and planning it
(``schedule.plan``, EASY backfill), with 100 to 5,000 pending jobs and 64 running ones.

    .venv/bin/python bench/sched_bench.py [--rounds N]

A pass runs once per turn of the agent's loop in which a job was submitted, ended, held or
released; this is its price per turn, next to the launch costs of bench.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tether.agent import schedule  # noqa: E402
from tether.agent.db import Store  # noqa: E402
from tether.agent.scheduler import SCHED_WINDOW  # noqa: E402


def fill(store: Store, pending: int) -> None:
    env = {f"VAR{i}": "x" * 40 for i in range(40)}  # a submitter's environment, ~2 KB
    store.begin()
    for i in range(1, pending + 1):
        store.insert(id=i, name="job", command=["./prog", str(i)], state="pending",
                     cpus_per_task=1 + i % 4, ntasks=1, gpus_req=0, memory_mb=100,
                     output="o", error="e", workdir="/", env=env, submitted_at="now")
        if i % 3:
            store.set_sched(i, time_limit=60.0 * (1 + i % 10))
    store.commit()


def one_pass(store: Store, running: list[schedule.Running]) -> int:
    jobs = store.queue(0, SCHED_WINDOW)
    pending = [schedule.Pending(j.id, schedule.Res(j.cpus, j.gpus, j.memory_mb), j.time_limit)
               for j in jobs]
    plan = schedule.plan(pending, running, schedule.Res(2, 0, 1000), 0.0, grace=10.0)
    return len(plan.reasons)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=200)
    ns = p.parse_args()
    running = [schedule.Running(i, schedule.Res(1, 0, 100), 100.0 + i if i % 2 else None)
               for i in range(64)]
    print(f"{'pending':>8}  {'median ms':>9}  {'p95 ms':>7}")
    for pending in (100, 1000, 5000):
        with tempfile.TemporaryDirectory() as d:
            store = Store(os.path.join(d, "tether.db"))
            fill(store, pending)
            times = []
            for _ in range(ns.rounds):
                t0 = time.perf_counter()
                one_pass(store, running)
                times.append((time.perf_counter() - t0) * 1000)
            store.close()
        times.sort()
        print(f"{pending:>8}  {statistics.median(times):>9.2f}  "
              f"{times[int(len(times) * 0.95)]:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
