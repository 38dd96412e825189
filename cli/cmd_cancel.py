"""``cancel``: jobs by id, by filters, or the ids the filters let through."""

from __future__ import annotations

import argparse
import sys

from tether.cli.connect import agent_call, all_jobs
from tether.cli.errors import EXIT_ERROR, EXIT_USAGE, CliError
from tether.cli.format import say
from tether.cli.jobfilter import ALIASES, select
from tether.shared.errors import RemoteError
from tether.shared.paths import Layout


def cancel(layout: Layout, ns: argparse.Namespace) -> int:
    filtered = ns.state is not None or ns.user is not None or ns.name is not None
    if not ns.jobs and not filtered:
        raise CliError("cancel: name the jobs: JOB... or --state, --user, --name", EXIT_USAGE)
    targets: list[int] = list(dict.fromkeys(ns.jobs))
    if filtered:
        if ns.state is None:  # by default only what can still be cancelled
            ns.state = frozenset(ALIASES["active"])
        chosen = [j["id"] for j in select(all_jobs(layout), ns)]
        targets = [i for i in targets if i in set(chosen)] if targets else chosen
    failed = 0
    for job in targets:
        try:
            agent_call(layout, "cancel", {"job": job})
        except RemoteError as exc:
            # A job the filters chose may end before we get to it: that is what was wanted. And
            # filters choose among everyone's jobs: as scancel, only one's own are cancelled.
            if filtered and not ns.jobs and exc.code in ("state", "permission_denied"):
                continue
            say(f"tether: {exc.message}", file=sys.stderr)
            failed += 1
    return EXIT_ERROR if failed else 0
