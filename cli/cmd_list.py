"""``list``: the jobs the agent holds, oldest first (``--json``: the job objects as they are,
filtered, whatever ``--format`` says)."""

from __future__ import annotations

import os

from tether.cli.connect import all_jobs
from tether.cli.format import say
from tether.cli.jobfilter import select
from tether.cli.table import CLUSTER_FORMAT, DEFAULT_FORMAT, parse_format, render

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    import argparse

    from tether.shared.paths import Layout


def list_jobs(layout: Layout, ns: argparse.Namespace) -> int:
    # a cluster's node lists the cluster's jobs, with the node each runs on
    member = os.path.exists(layout.cluster_marker)
    cols = parse_format(ns.format or (CLUSTER_FORMAT if member else DEFAULT_FORMAT))
    jobs = select(all_jobs(layout), ns)
    if ns.json:
        from tether.cli.jsonout import dumps  # json.dumps's text, without json (~3 ms)

        print(dumps(jobs))
        return 0
    for line in render(jobs, cols, header=not ns.no_header):
        say(line)  # names and commands are the jobs' own: escaped
    return 0
