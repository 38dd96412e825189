"""Wall time of a 2- and 4-rank MPICH program under ``tether submit --wait --pmi pmi1`` and under
MPICH's own ``mpiexec -n N``, interleaved in one run (so both see the same machine load).

    .venv/bin/python bench/mpi_bench.py [--runs 10] [--json]

Builds tests/mpi/hello_mpi.c with ``mpicc.mpich`` and times ``mpiexec.mpich``: MPICH's own
names, since the plain ``mpicc``/``mpiexec`` follow Debian's alternatives, which an installed
Open MPI takes over. Starts its own agent on a temporary state directory, and kills everything
it started on the way out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import ScratchAgent  # noqa: E402

TETHER = [sys.executable, "-m", "tether.cli.main"]


def timed(argv: list[str], env: dict[str, str], cwd: str) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(argv, env=env, cwd=cwd, capture_output=True)
    elapsed = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.decode()}")
    return elapsed * 1000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    node = ScratchAgent("tmb", cpus=4)
    env, work = node.env, node.work
    results: dict[str, list[float]] = {}
    try:
        exe = os.path.join(node.base, "hello_mpi")
        subprocess.run(["mpicc.mpich", "-O1", "-o", exe,
                        os.path.join(ROOT, "tests/mpi/hello_mpi.c")], check=True)
        for n in (2, 4):  # one warm-up each
            timed(["mpiexec.mpich", "-n", str(n), exe], env, work)
            timed([*TETHER, "submit", "--wait", "--ntasks", str(n), "--pmi", "pmi1", "--", exe],
                  env, work)
        for _ in range(ns.runs):
            for n in (2, 4):
                results.setdefault(f"mpiexec -n {n}", []).append(
                    timed(["mpiexec.mpich", "-n", str(n), exe], env, work))
                results.setdefault(f"tether --ntasks {n}", []).append(
                    timed([*TETHER, "submit", "--wait", "--ntasks", str(n), "--pmi", "pmi1",
                           "--", exe], env, work))
    finally:
        node.close()
    summary = {k: {"median_ms": round(statistics.median(v), 1), "min_ms": round(min(v), 1),
                   "max_ms": round(max(v), 1), "runs": len(v)} for k, v in results.items()}
    if ns.json:
        print(json.dumps(summary))
    else:
        print(f"MPICH hello (Allreduce, ring Sendrecv, Barrier), {ns.runs} interleaved runs, "
              f"load {os.getloadavg()[0]:.2f}; tether timed with "
              f"{sys.executable} -m tether.cli.main")
        for k, s in summary.items():
            print(f"  {k:<18} median {s['median_ms']:7.1f} ms  (min {s['min_ms']}, "
                  f"max {s['max_ms']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
