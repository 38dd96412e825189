"""``cancel``: jobs by id, by filters, or the ids the filters let through."""

from __future__ import annotations

import sys

from tether.cli.argtypes import ref_args
from tether.cli.connect import agent_call, all_jobs
from tether.cli.errors import EXIT_ERROR, EXIT_USAGE, CliError
from tether.cli.format import say
from tether.shared.errors import RemoteError

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    import argparse

    from tether.shared.paths import Layout


def cancel(layout: Layout, ns: argparse.Namespace) -> int:
    filtered = ns.state is not None or ns.user is not None or ns.name is not None
    if not ns.jobs and not filtered:
        raise CliError("cancel: name the jobs: JOB... or --state, --user, --name", EXIT_USAGE)
    targets: list[str] = list(dict.fromkeys(ns.jobs))
    if filtered:  # the filters' modules (argparse, time formats, the table) only for them
        from tether.cli.jobfilter import ALIASES, select
        from tether.cli.table import label

        if ns.state is None:  # by default only what can still be cancelled
            ns.state = frozenset(ALIASES["active"])
        picked = select(all_jobs(layout), ns)
        if targets:
            # a named array stands for its elements, a named element for itself
            names = {ref for j in picked
                     for ref in (str(j["id"]), label(j), str(j.get("array_id")))}
            targets = [ref for ref in targets if ref in names]
        else:
            targets = [label(j) for j in picked]
    failed = 0
    for job in targets:
        try:
            agent_call(layout, "cancel", ref_args(job))
        except RemoteError as exc:
            # A job the filters chose may end before we get to it: that is what was wanted. And
            # filters choose among everyone's jobs: as scancel, only one's own are cancelled.
            if filtered and not ns.jobs and exc.code in ("state", "permission_denied"):
                continue
            say(f"tether: {exc.message}", file=sys.stderr)
            failed += 1
    return EXIT_ERROR if failed else 0


def hold(layout: Layout, ns: argparse.Namespace) -> int:
    return _each(layout, "hold", ns.jobs)


def release(layout: Layout, ns: argparse.Namespace) -> int:
    return _each(layout, "release", ns.jobs)


def _each(layout: Layout, kind: str, jobs: list[str]) -> int:
    """``kind`` for every job named; each failure on a line of its own, exit 1 if any."""
    failed = 0
    for job in dict.fromkeys(jobs):
        try:
            agent_call(layout, kind, ref_args(job))
        except RemoteError as exc:
            say(f"tether: {exc.message}", file=sys.stderr)
            failed += 1
    return EXIT_ERROR if failed else 0
