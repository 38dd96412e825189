"""``upgrade-supervisors``: re-exec running supervisors into the installed tether (handover).

Steps end while it runs (it goes through them one at a time, ~0.3 s each): a step found at the
start that is gone, refuses the upgrade or goes away during it, and has ended meanwhile
(``ended_meanwhile``: its exit record, or its run directory collected for a job that did not
end lost), is done, said as such; only a step still running that could not be upgraded is an
error.
"""

from __future__ import annotations

import argparse
import os
import sys

import tether
from tether.cli.errors import EXIT_ERROR, CliError
from tether.cli.format import say
from tether.shared.client import probe_unix
from tether.shared.errors import RemoteError, TetherError, Unreachable
from tether.shared.paths import Layout
from tether.shared.step_client import SupervisorGone, connect

#: how long one supervisor may take to come back as the installed release
DEADLINE = 30.0


def upgrade_one(layout: Layout, job: int, seen: bool = False) -> str | None:
    """Upgrade ``job``'s supervisor; a line to print, or None when its step has ended.
    ``seen``: its run directory was there when the call began (so its step may end during
    the call, which is no failure)."""
    try:
        with connect(job, state_dir=layout.state_dir) as step:
            before = dict(step.hello)
            if before.get("phase") not in ("ready", "running"):
                return None
            step.call("upgrade", timeout=30.0)  # it probes the installed build first
            after = step.await_new_image(DEADLINE)
    except (SupervisorGone, Unreachable, RemoteError) as exc:
        if isinstance(exc, RemoteError) and exc.code != "state":
            raise
        if seen and ended_meanwhile(layout, job):
            return f"job {job}: its step ended during the upgrade; left as it is"
        raise
    same = (after.get("pid"), after.get("start_ticks")) == (before.get("pid"),
                                                            before.get("start_ticks"))
    if not same:
        raise TetherError(f"job {job}: a different process answers after the upgrade")
    if after.get("version") != tether.__version__:
        raise TetherError(f"job {job}: its supervisor came back as {after.get('version')}, "
                          f"not the installed {tether.__version__}")
    return (f"job {job}: supervisor {after['pid']} {before.get('version')} -> "
            f"{after['version']} (generation {after.get('generation')})")


def ended_meanwhile(layout: Layout, job: int) -> bool:
    """Has the step of ``job`` (whose run directory was there) ended? Its newest run
    directory holds its exit record or its supervisor says its phase is past running; or no
    run directory is left (the agent collected the result), unless the agent says the job
    was lost (its supervisor died: that is a failure, not an end)."""
    attempts = [rd for rd in layout.run_dirs() if rd.job == job]
    if not attempts:
        try:
            from tether.cli.connect import agent_call

            state = agent_call(layout, "show", {"job": job}).get("state")
        except (CliError, TetherError):
            return True  # no agent to ask: it collected the result before it went
        return state in ("completed", "failed", "cancelled", "timeout")
    rd = attempts[-1]
    if os.path.exists(rd.sentinel):
        return True
    try:
        with connect(job, state_dir=layout.state_dir) as step:
            return step.hello.get("phase") not in ("ready", "running")
    except TetherError:
        return False


def live_jobs(layout: Layout) -> list[int]:
    """Every job with a run directory whose socket someone serves (agent or not)."""
    return sorted({rd.job for rd in layout.run_dirs() if probe_unix(rd.sock) is None})


def upgrade_supervisors(layout: Layout, ns: argparse.Namespace) -> int:
    jobs = list(ns.jobs) or live_jobs(layout)
    present = {rd.job for rd in layout.run_dirs()}
    failed = False
    for job in jobs:
        try:
            line = upgrade_one(layout, job, seen=job in present)
        except TetherError as exc:
            say(f"tether: {exc.message}", file=sys.stderr, flush=True)
            failed = True
            continue
        print(line if line is not None else f"job {job}: its step has ended; left as it is",
              flush=True)
    return EXIT_ERROR if failed else 0
