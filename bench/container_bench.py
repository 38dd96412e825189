"""What running a task in a container costs (issue 31): ``tether submit --wait -- true``
against ``tether submit --wait --container ROOTFS -- true``, interleaved in one run (so both see
the same machine load), as user ``nobody`` (a container job's real path: the runtime rootless,
as the user), with the node's default runtime (crun) and with runc.

    .venv/bin/python bench/container_bench.py [--runs 20] [--json]     (root)

Makes a root filesystem of Debian's busybox-static, starts its own agent (with
``--container-remap-root``, which runc needs) on a temporary state directory, and kills
everything it started on the way out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import ScratchAgent  # noqa: E402

NOBODY = 65534


def rootfs(top: str) -> str:
    for d in ("bin", "proc", "dev", "sys", "tmp", "home"):
        os.makedirs(os.path.join(top, d))
    shutil.copy("/bin/busybox", os.path.join(top, "bin", "busybox"))
    for applet in ("sh", "true"):
        os.symlink("busybox", os.path.join(top, "bin", applet))
    return top


def timed(argv: list[str], env: dict[str, str], cwd: str) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, user=NOBODY,
                         group=NOBODY, extra_groups=[])
    elapsed = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.decode()}")
    return elapsed * 1000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the jobs run as nobody")
    node = ScratchAgent("tcb", cpus=2, extra=["--container-remap-root"])
    os.chmod(node.base, 0o755)
    os.chown(node.work, NOBODY, NOBODY)
    env = dict(node.env, HOME="/nonexistent", PATH="/usr/bin:/bin")
    fs = rootfs(os.path.join(node.base, "rootfs"))
    submit = [*node.tether, "submit", "--wait"]
    variants = {
        "plain": [*submit, "--", "/bin/true"],
        "crun": [*submit, "--container", fs, "--", "/bin/true"],
        "runc": [*submit, "--container", fs, "--container-runtime", "runc", "--", "/bin/true"],
    }
    results: dict[str, list[float]] = {}
    try:
        for argv in variants.values():  # one warm-up each
            timed(argv, env, node.work)
        for _ in range(ns.runs):
            for name, argv in variants.items():
                results.setdefault(name, []).append(timed(argv, env, node.work))
    finally:
        node.close()
    summary = {k: {"median_ms": round(statistics.median(v), 1), "min_ms": round(min(v), 1),
                   "max_ms": round(max(v), 1), "runs": len(v)} for k, v in results.items()}
    base = summary["plain"]["median_ms"]
    for s in summary.values():
        s["ratio"] = round(s["median_ms"] / base, 2)
    if ns.json:
        print(json.dumps(summary))
    else:
        print(f"submit --wait -- true as nobody, {ns.runs} interleaved runs, load "
              f"{os.getloadavg()[0]:.2f}")
        for k, s in summary.items():
            print(f"  {k:<6} median {s['median_ms']:7.1f} ms  (min {s['min_ms']}, max "
                  f"{s['max_ms']}; x{s['ratio']} of plain)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
