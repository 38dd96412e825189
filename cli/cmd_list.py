"""``list``: the jobs the agent holds, oldest first."""

from __future__ import annotations

import argparse
import json

from tether.cli.connect import all_jobs
from tether.cli.format import fmt_exit, say
from tether.shared.paths import Layout


def list_jobs(layout: Layout, ns: argparse.Namespace) -> int:
    jobs = all_jobs(layout)
    if ns.json:
        print(json.dumps(jobs))
        return 0
    for j in jobs:
        say(f"{j['id']:>6}  {j['state']:<10} {fmt_exit(j):<6} {j['name']:<16} "
              f"{' '.join(j['command'])}")
    return 0
