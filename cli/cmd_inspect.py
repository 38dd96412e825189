"""``inspect``: ask the job's supervisor directly (works while the agent is down)."""

from __future__ import annotations

import sys

from tether.cli.connect import job_id_of, open_step, supervisor_errors
from tether.cli.errors import EXIT_USAGE, CliError
from tether.cli.format import fmt_exit, print_pairs, say
from tether.shared.errors import RemoteError, VersionMismatch

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from tether.shared.paths import Layout
    from tether.shared.step_client import StepClient


def dumps(value: Any) -> str:
    """``json.dumps``'s text, for the --json forms only (``jsonout``)."""
    from tether.cli.jsonout import dumps

    return dumps(value)


def inspect(layout: Layout, ns: argparse.Namespace) -> int:
    if ns.lines is not None and not ns.output:
        raise CliError("inspect: --lines goes with --output", EXIT_USAGE)
    info: dict[str, Any] | None = None
    ns.job = job_id_of(layout, ns.job)
    with open_step(layout, ns.job) as step, supervisor_errors(ns.job):
        if ns.pids:
            return show_pids(step.pids(), ns.json)
        if ns.stats:
            return show_stats(step.stats(), ns.json)
        if ns.output:
            lines = 10 if ns.lines is None else ns.lines
            return show_output(step.call("output", {"lines": lines}), ns.json)
        if ns.events:
            return show_events(step, ns.json)
        st = step.pmi() if ns.pmi else step.state()
        if not ns.pmi:
            try:  # shown too when the caller may see it (the owner, root, the agent)
                info = step.info()
            except VersionMismatch:  # a supervisor older than `info`: what `state` says
                pass
            except RemoteError as exc:  # not allowed
                if exc.code != "permission_denied":
                    raise
    if ns.json:
        print(dumps(st if info is None else dict(st, info=info)))
        return 0
    if ns.pmi:
        return show_pmi(st)
    print_pairs((key, st.get(key)) for key in ("job", "attempt", "state", "phase",
                                                "supervisor_pid", "pids", "started_at",
                                                "ended_at"))
    if st.get("exit"):
        say(f"{'exit':<15}{fmt_exit(st['exit'])} {st['exit'].get('reason') or ''}".rstrip())
    if info is not None:
        user = f"{info['user'] or '?'} (uid {info['uid']})"
        print_pairs([("name", info["name"]), ("command", " ".join(info["command"])),
                     ("user", user), ("workdir", info["workdir"]), ("ntasks", info["ntasks"]),
                     ("cpus", info["cpus"]), ("gpus", info["gpus"]),
                     ("memory_mb", info["memory_mb"]), ("output", info["output"]),
                     ("error", info["error"]), ("pmi", info["pmi"]),
                     ("version", f"{info['version']} (protocol {info['protocol']})")])
    return 0


def show_pmi(st: dict[str, Any]) -> int:
    say(f"{st['kind']} job {st['jobid']}: {st['size']} ranks, epoch {st['epoch']}, "
          f"{st['kvs_keys']} keys ({st['store_bytes']} bytes), waiting "
          f"{st['waiting'] or 'none'}{', failure: ' + st['failure'] if st['failure'] else ''}")
    for r in st["ranks"]:
        flags = [k for k in ("connected", "initialized", "finalized", "aborted", "exited")
                 if r.get(k)]
        say(f"  rank {r['rank']}: {r['protocol'] or '-'} {' '.join(flags)}")
    return 0


def task_status(t: dict[str, Any]) -> str:
    if t["alive"]:
        return "alive"
    if t.get("signal") is not None:
        return f"killed by signal {t['signal']}"
    if t.get("exit_code") is not None:
        return f"exited {t['exit_code']}"
    return t.get("reason") or "not started"


def show_pids(res: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(dumps(res))
        return 0
    print(f"{'RANK':<6}{'PID':<9}STATUS")
    for t in res["tasks"]:
        say(f"{t['rank']:<6}{t['pid'] or '-':<9}{task_status(t)}")
    if res["processes"]:
        print(f"\n{'PID':<9}{'PPID':<9}{'RANK':<6}{'STATE':<6}COMMAND")
        for p in res["processes"]:
            rank = "-" if p["rank"] is None else p["rank"]
            note = "  (adopted by the supervisor)" if p["adopted"] else ""
            say(f"{p['pid']:<9}{p['ppid']:<9}{rank!s:<6}{p['state']:<6}{p['comm']}{note}")
    if res.get("truncated"):
        print("(more processes not shown)")
    return 0


def show_stats(res: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(dumps(res))
        return 0
    print(f"{'RANK':<9}{'PID':<9}{'USER_S':>9}{'SYS_S':>9}{'RSS_KB':>11}{'PEAK_KB':>11}"
          f"{'ELAPSED_S':>11}  STATUS")

    def row(label: str, pid: Any, u: dict[str, Any], status: str) -> None:
        elapsed = "" if u.get("elapsed") is None else f"{u['elapsed']:.2f}"
        print(f"{label:<9}{pid!s:<9}{u['cpu_user']:>9.2f}{u['cpu_system']:>9.2f}"
              f"{u['rss_kb']:>11}{u['peak_rss_kb']:>11}{elapsed:>11}  {status}".rstrip())
    for t in res["tasks"]:
        row(str(t["rank"]), t["pid"] or "-", t, "alive" if t["alive"] else "ended")
    if res["adopted"]["processes"]:
        row("adopted", "-", res["adopted"], f"{res['adopted']['processes']} process(es)")
    row("total", "-", res["total"], "")
    cg = res.get("cgroup")  # supervisors before issue 9, or a step without a cgroup: none
    if isinstance(cg, dict):
        print("\n" + cgroup_line(cg))
    return 0


def cgroup_line(cg: dict[str, Any]) -> str:
    """The kernel's own counts for the whole step (its cgroup), daemons included."""
    def mib(v: Any) -> str:
        return "-" if v is None else f"{v / 1048576:.1f} MiB"
    limit = f"{cg['memory_limit_mb']} MB" if cg.get("memory_limit_mb") else "none"
    cpu = "-" if cg.get("cpu_seconds") is None else f"{cg['cpu_seconds']:.2f} s"
    return (f"cgroup ({cg.get('mode')}): memory {mib(cg.get('memory_current'))}, peak "
            f"{mib(cg.get('memory_peak'))}, limit {limit}; cpu {cpu}; pids {cg.get('pids')}"
            + ("; frozen" if cg.get("frozen") else ""))


def show_output(res: dict[str, Any], as_json: bool) -> int:
    streams = [name for name in ("stdout", "stderr") if name in res]
    if as_json:
        print(dumps({name: dict(res[name], data=res[name]["data"].decode(
            errors="replace")) for name in streams}))
        return 0
    for name in streams:
        out = sys.stdout if name == "stdout" else sys.stderr
        out.flush()
        out.buffer.write(res[name]["data"])
        out.buffer.flush()
    return 0


def show_events(step: StepClient, as_json: bool) -> int:
    events: list[dict[str, Any]] = []
    while True:  # pages of at most 1000; hold 0: what there is now
        res = step.call("events", {"after": len(events)})
        events.extend(res["events"])
        if not res["events"]:
            break
    if as_json:
        print(dumps({"events": events, "ended": res["ended"]}))
        return 0
    for e in events:
        extra = " ".join(f"{k}={e[k]}" for k in ("rank", "pid", "state", "exit_code", "signal",
                                                  "reason") if e.get(k) is not None)
        say(f"{e['seq']:<6}{e['time']}  {e['kind']:<13} {extra}".rstrip())
    return 0
