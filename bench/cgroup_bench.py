"""What a cgroup per step costs (issue 9): the start of a job, and killing a step.

    nice .venv/bin/python bench/cgroup_bench.py [--runs N] [--jobs N] [--json]

Three figures, each a median (root only; both cgroup modes this host offers):

- ``launch``: in-process, what the supervisor adds to one task's start: create the step's
  cgroup (with a memory limit where there is one), fork and exec ``true`` from inside it
  (``StepCgroup.joined``), wait, remove it; against the same fork and exec without it. Rounds
  alternate, so both sides see the same machine, and are 50 ms apart: a write to
  ``cgroup.procs`` waits for an RCU grace period unless another came just before, so a tight
  loop would measure the cheap case a supervisor never sees.
- ``submit``: end to end, ``tether submit --wait -- true`` against two agents at once, one with
  ``--cgroup none`` and one with the host's default (``auto``), alternating.
- ``kill``: a step of 100 processes (a shell and 99 ``sleep``; one of them ``setsid``), from the
  kill to an empty cgroup (``StepCgroup.kill_and_wait``: v2 ``cgroup.kill``; v1 freeze, SIGKILL
  each pid, thaw).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ScratchAgent  # noqa: E402
from tether.shared import cgroup_host, step_cgroup  # noqa: E402
from tether.shared.cgroup_layout import Host, base_dirs, step_plan  # noqa: E402

TRUE = "/bin/true"


def hosts() -> dict[str, Host]:
    found = {}
    for mode in ("hybrid", "v1", "v2"):
        host = cgroup_host.probe(mode)
        if host.mode == mode:
            found[mode] = host
    return found


def ms(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(values) * 1000, 3),
            "min_ms": round(min(values) * 1000, 3), "n": len(values)}


def make_step(host: Host, base: str, n: int, memory_mb: int) -> step_cgroup.StepCgroup:
    plan = step_plan(host.mode, base_dirs(host, base), 1, n, memory_mb, host.memory)
    return step_cgroup.StepCgroup(plan)


def bench_launch(host: Host, base: str, runs: int) -> dict[str, Any]:
    plain: list[float] = []
    contained: list[float] = []
    for r in range(runs + 2):
        t0 = time.perf_counter()
        subprocess.Popen([TRUE], close_fds=True).wait()
        t1 = time.perf_counter()
        cg = make_step(host, base, r, 512)
        cg.create()
        with cg.joined():
            proc = subprocess.Popen([TRUE], close_fds=True)
        proc.wait()
        cg.kill_and_wait()
        cg.remove()
        t2 = time.perf_counter()
        if r >= 2:  # warm-up rounds
            plain.append(t1 - t0)
            contained.append(t2 - t1)
        time.sleep(0.05)
    added = [c - p for c, p in zip(contained, plain, strict=True)]
    return {"without": ms(plain), "with": ms(contained), "added": ms(added)}


def bench_kill(host: Host, base: str, runs: int) -> dict[str, Any]:
    times = []
    for r in range(runs):
        cg = make_step(host, base, 1000 + r, 0)
        cg.create()
        with cg.joined():
            proc = subprocess.Popen(["sh", "-c", "setsid sleep 300 & for i in $(seq 98); do "
                                     "sleep 300 & done; wait"], close_fds=True)
        deadline = time.monotonic() + 30
        while len(cg.procs()) < 100:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {len(cg.procs())} processes started")
            time.sleep(0.01)
        t0 = time.perf_counter()
        ok = cg.kill_and_wait(5.0)
        times.append(time.perf_counter() - t0)
        proc.wait()
        if not ok or not cg.remove():
            raise SystemExit("the cgroup did not empty")
    return {"processes": 100, **ms(times)}


def submit_times(agent: ScratchAgent) -> float:
    t0 = time.perf_counter()
    subprocess.run([*agent.tether, "submit", "--wait", "--", TRUE], env=agent.env,
                   cwd=agent.work, check=True, capture_output=True)
    return time.perf_counter() - t0


def bench_submit(jobs: int) -> dict[str, Any]:
    agents = {}
    try:
        for mode in ("none", "auto"):
            agents[mode] = ScratchAgent("cgb", 2, extra=["--cgroup", mode])
        got: dict[str, list[float]] = {m: [] for m in agents}
        for r in range(jobs + 2):
            for mode, agent in agents.items():
                t = submit_times(agent)
                if r >= 2:
                    got[mode].append(t)
        out: dict[str, Any] = {m: ms(v) for m, v in got.items()}
        out["auto_is"] = json.loads(subprocess.run(
            [*agents["auto"].tether, "status", "--json"], env=agents["auto"].env,
            capture_output=True, check=True).stdout)["cgroup"]["mode"]
        return out
    finally:
        for agent in agents.values():
            agent.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=50, help="in-process rounds (default 50)")
    ap.add_argument("--jobs", type=int, default=20, help="submit --wait rounds (default 20)")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("cgroup_bench: needs root")
    base = "tether-bench-" + os.path.basename(tempfile.mkdtemp(prefix="cgb"))
    result: dict[str, Any] = {}
    try:
        for mode, host in hosts().items():
            for path in base_dirs(host, base).values():
                os.makedirs(path, exist_ok=True)
            print(f"{mode}: launch ...", file=sys.stderr)
            result[f"launch_{mode}"] = bench_launch(host, base, ns.runs)
            print(f"{mode}: kill ...", file=sys.stderr)
            result[f"kill_{mode}"] = bench_kill(host, base, max(5, ns.runs // 5))
        print("submit --wait ...", file=sys.stderr)
        result["submit"] = bench_submit(ns.jobs)
    finally:
        for host in hosts().values():
            for path in base_dirs(host, base).values():
                step_cgroup.remove_tree(path)
    if ns.json:
        print(json.dumps(result))
        return 0
    for mode in ("hybrid", "v1", "v2"):
        if f"launch_{mode}" in result:
            la, k = result[f"launch_{mode}"], result[f"kill_{mode}"]
            print(f"{mode}: one task's start {la['without']['median_ms']} ms without a cgroup, "
                  f"{la['with']['median_ms']} ms with (added {la['added']['median_ms']} ms, "
                  f"median of {la['added']['n']}); killing a step of 100 processes "
                  f"{k['median_ms']} ms (median of {k['n']}, min {k['min_ms']})")
    s = result["submit"]
    print(f"submit --wait -- true: {s['none']['median_ms']} ms with --cgroup none, "
          f"{s['auto']['median_ms']} ms with auto ({s['auto_is']}), median of {s['none']['n']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
