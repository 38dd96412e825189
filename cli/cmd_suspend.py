"""``suspend JOB`` and ``resume JOB``: freeze and thaw a running job (its cgroup's freezer).

``resume`` also names nodes (``tether resume n1`` lets a drained cluster node take work): an
argument of digits is a job, anything else a node (cli/cluster.py), which needs a cluster.
"""

from __future__ import annotations

import argparse

from tether.cli.connect import agent_call
from tether.cli.errors import EXIT_USAGE, CliError
from tether.shared.paths import Layout


def suspend(layout: Layout, ns: argparse.Namespace) -> int:
    agent_call(layout, "suspend", {"job": ns.job})
    return 0


def resume(layout: Layout, ns: argparse.Namespace) -> int:
    job = getattr(ns, "job", None)
    if job is None:
        if not str(ns.node).isdigit():
            raise CliError(f"resume: {ns.node!r} is not a job id, and resuming a node needs a "
                           "cluster (--cluster DSN or TETHER_CLUSTER)", EXIT_USAGE)
        job = int(ns.node)
    agent_call(layout, "resume", {"job": job})
    return 0
