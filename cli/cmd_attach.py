"""``attach`` (follow a step's output) and ``signal``: both talk to the supervisor only."""

from __future__ import annotations

import argparse
import os
import sys

from tether.cli.connect import job_id_of, open_step, supervisor_errors
from tether.cli.errors import EXIT_USAGE, CliError
from tether.cli.format import say
from tether.shared.errors import Unreachable
from tether.shared.paths import Layout
from tether.shared.step_client import parse_signal


def attach(layout: Layout, ns: argparse.Namespace) -> int:
    outs = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}
    warned = False
    ns.job = job_id_of(layout, ns.job)
    with open_step(layout, ns.job) as step, supervisor_errors(ns.job):
        offsets: dict[str, int] = {}
        while True:
            try:
                for name, data in step.follow_output(offsets=offsets):
                    outs[name].write(data)
                    outs[name].flush()
            except Unreachable as exc:  # alive but silent (stopped?): keep trying
                offsets = dict(step.offsets)
                if not warned:
                    say(f"tether: job {ns.job}: {exc.message}; still trying", file=sys.stderr,
                        flush=True)
                    warned = True
                continue
            except BrokenPipeError:  # our reader went away: detach quietly
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 0
            break
        if step.fell_back and step.last_phase not in ("exited", "aborted"):
            print(f"tether: job {ns.job}: its supervisor went away before the step ended; "
                  "the output was read to the end of its files", file=sys.stderr)
    return 0


def signal(layout: Layout, ns: argparse.Namespace) -> int:
    try:
        num = parse_signal(ns.signal)
    except ValueError as exc:
        raise CliError(f"signal: {exc}", EXIT_USAGE) from None
    ns.job = job_id_of(layout, ns.job)
    with open_step(layout, ns.job) as step, supervisor_errors(ns.job):
        step.signal(num, ns.rank)
    return 0
