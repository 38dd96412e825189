"""``upgrade-supervisors``: re-exec running supervisors into the installed tether (handover)."""

from __future__ import annotations

import argparse
import sys

import tether
from tether.cli.errors import EXIT_ERROR
from tether.shared.client import probe_unix
from tether.shared.errors import TetherError
from tether.shared.paths import Layout
from tether.shared.step_client import connect

#: how long one supervisor may take to come back as the installed release
DEADLINE = 30.0


def upgrade_one(layout: Layout, job: int) -> str | None:
    """Upgrade ``job``'s supervisor; a line to print, or None when its step has ended."""
    with connect(job, state_dir=layout.state_dir) as step:
        before = dict(step.hello)
        if before.get("phase") not in ("ready", "running"):
            return None
        step.call("upgrade", timeout=30.0)  # it probes the installed build first
        after = step.await_new_image(DEADLINE)
    same = (after.get("pid"), after.get("start_ticks")) == (before.get("pid"),
                                                            before.get("start_ticks"))
    if not same:
        raise TetherError(f"job {job}: a different process answers after the upgrade")
    if after.get("version") != tether.__version__:
        raise TetherError(f"job {job}: its supervisor came back as {after.get('version')}, "
                          f"not the installed {tether.__version__}")
    return (f"job {job}: supervisor {after['pid']} {before.get('version')} -> "
            f"{after['version']} (generation {after.get('generation')})")


def live_jobs(layout: Layout) -> list[int]:
    """Every job with a run directory whose socket someone serves (agent or not)."""
    return sorted({rd.job for rd in layout.run_dirs() if probe_unix(rd.sock) is None})


def upgrade_supervisors(layout: Layout, ns: argparse.Namespace) -> int:
    jobs = list(ns.jobs) or live_jobs(layout)
    failed = False
    for job in jobs:
        try:
            line = upgrade_one(layout, job)
        except TetherError as exc:
            print(f"tether: {exc.message}", file=sys.stderr, flush=True)
            failed = True
            continue
        print(line if line is not None else f"job {job}: its step has ended; left as it is",
              flush=True)
    return EXIT_ERROR if failed else 0
