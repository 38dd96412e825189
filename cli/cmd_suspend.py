"""``suspend JOB`` and ``resume JOB``: freeze and thaw a running job (its cgroup's freezer).

``resume`` also names nodes (``tether resume n1`` lets a drained cluster node take work): an
argument of digits (or ``ARRAY_INDEX``, an array element such as ``12_3``) is a job, anything
else a node (cli/cluster.py), which the agent answers only as a cluster's member.
"""

from __future__ import annotations

import argparse

from tether.cli.argtypes import ref_args
from tether.cli.connect import agent_call
from tether.cli.errors import EXIT_USAGE, CliError
from tether.shared.paths import Layout


def names_job(text: str) -> bool:
    """Is ``resume``'s argument a job (``ID`` or ``ARRAY_INDEX``) rather than a node?"""
    job, sep, index = text.partition("_")
    return job.isdigit() and (not sep or index.isdigit())


def suspend(layout: Layout, ns: argparse.Namespace) -> int:
    agent_call(layout, "suspend", ref_args(str(ns.job)))
    return 0


def resume(layout: Layout, ns: argparse.Namespace) -> int:
    ref = str(getattr(ns, "job", None) or ns.node)
    if not names_job(ref):
        from tether.cli.cluster import cmd_drain

        return cmd_drain(layout, ns)  # a node: the agent refuses unless it is a member
    from tether.cli.argtypes import job_ref

    try:
        ref = job_ref(ref)
    except argparse.ArgumentTypeError as exc:
        raise CliError(f"resume: {exc}", EXIT_USAGE) from None
    agent_call(layout, "resume", ref_args(ref))
    return 0
