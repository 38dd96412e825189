"""``status`` (the agent and what it holds) and ``show`` (one job)."""

from __future__ import annotations

import sys

from tether.cli.argtypes import ref_args
from tether.cli.connect import agent_call
from tether.cli.errors import EXIT_ERROR, CliError
from tether.cli.format import print_job, say

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    import argparse

    from tether.shared.paths import Layout


def status(layout: Layout, ns: argparse.Namespace) -> int:
    try:
        st = agent_call(layout, "status", timeout=5.0)
    except CliError as exc:
        if ns.json:
            from tether.cli.jsonout import dumps  # json.dumps's text, without json (~3 ms)

            print(dumps({"running": False, "error": str(exc)}))
        say(f"tether: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if ns.json:
        from tether.cli.jsonout import dumps

        print(dumps(st))
        return 0
    say(f"agent on node {st['node']} (version {st['version']}, pid {st['pid']})")
    for res in ("cpus", "gpus", "memory_mb"):
        print(f"  {res:<10} {st[res]['allocated']}/{st[res]['total']} allocated")
    beyond = st.get("beyond_node") or {}  # an agent of before 0.4 does not say
    held = [f"{res} {', '.join(map(str, beyond[res]))}" for res in ("cpus", "gpus")
            if beyond.get(res)]
    if beyond.get("memory_mb"):
        held.append(f"memory_mb {beyond['memory_mb']}")
    if held:
        print(f"  {'beyond':<10} {'; '.join(held)} (held by running steps beyond this node's "
              "size)")
    over = st.get("oversubscribed")
    if over:
        print(f"  {'':<10} oversubscribed: {over['logical']} logical CPUs on "
              f"{len(over['real'])} real ({','.join(str(c) for c in over['real'])})")
    counts = ", ".join(f"{k} {v}" for k, v in st["jobs"].items() if v)
    print(f"  {'jobs':<10} {counts or 'none'}")
    cg = st.get("cgroup")  # agents before issue 9 do not say
    if isinstance(cg, dict):
        if cg.get("mode") == "none":
            line = f"none ({cg.get('note')})" if cg.get("note") else "none"
        else:
            how = "enforced" if cg.get("memory_enforced") else "counted"
            line = f"{cg.get('mode')}, memory {how}"
        print(f"  {'cgroups':<10} {line}")
    tpl = st.get("template")  # agents before issue 28 do not say
    if isinstance(tpl, dict):
        line = f"pid {tpl['pid']}" if tpl.get("pid") else "none running"
        if tpl.get("down"):
            line += f" ({tpl['down']})"
        print(f"  {'template':<10} {line}")
    return 0


def show(layout: Layout, ns: argparse.Namespace) -> int:
    job = agent_call(layout, "show", ref_args(ns.job))
    if ns.json:
        from tether.cli.jsonout import dumps

        print(dumps(job))
    else:
        print_job(job)
    return 0
