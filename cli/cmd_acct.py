"""``acct``: the accounting history of ended jobs, as Slurm's ``sacct`` shows it (agent/acct.py
keeps it, apart from the jobs ``list`` shows, so it outlives a purge of ended jobs).

Like sacct, a user sees her own jobs unless she names users (``--user``), asks for everyone's
(``--all-users``) or names jobs; root sees everyone's. Columns as ``list``'s (fixed widths, a
longer value cut with ``+``), or ``--parsable`` (sacct's ``-p``: every value whole, ``|`` after
each) and ``--parsable2`` (``-P``: ``|`` between values), or ``--json`` (the records).
"""

from __future__ import annotations

import os

from tether.cli.connect import agent_call
from tether.cli.errors import EXIT_USAGE, CliError
from tether.cli.format import say
from tether.cli.table import Field, label, render, text
from tether.cli.timefmt import duration, local, parse_stamp

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from tether.shared.paths import Layout

#: --units: what a memory figure is shown in (sacct's --units), KiB per unit
UNITS = {"K": 1, "M": 1024, "G": 1024 * 1024}


def cpu_time(seconds: float | None) -> str:
    """sacct's CPU time: ``MM:SS.mmm`` under an hour, else ``[D-]HH:MM:SS``."""
    if seconds is None:
        return ""
    ms = int(round(max(0.0, seconds) * 1000))
    s, ms = divmod(ms, 1000)
    m, s = divmod(s, 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    if d:
        return f"{d}-{h:02}:{m:02}:{s:02}"
    if h:
        return f"{h:02}:{m:02}:{s:02}"
    return f"{m:02}:{s:02}.{ms:03}"


def memory(kb: int | None, unit: str) -> str:
    if kb is None:
        return ""
    if unit == "K":
        return f"{kb}K"
    return f"{kb / UNITS[unit]:.2f}{unit}"


def exit_code(r: dict[str, Any]) -> str:
    """sacct's ExitCode: ``CODE:SIGNAL``."""
    return f"{r.get('exit_code') or 0}:{r.get('signal') or 0}"


def fields(unit: str) -> dict[str, Field]:
    def mem(key: str) -> Any:
        return lambda r: memory(r.get(key), unit)

    return {
        "id": Field("ID", 9, label, True, "job id (ARRAY_INDEX for an array element)"),
        "jobid": Field("JOBID", 7, lambda r: text(r.get("id")), True, "the job's own id"),
        "name": Field("NAME", 16, lambda r: text(r.get("name")), help="job name"),
        "user": Field("USER", 9, lambda r: text(r.get("user")), help="who the tasks ran as"),
        "state": Field("STATE", 10, lambda r: text(r.get("state")),
                       help="completed, failed, cancelled, timeout, lost"),
        "exitcode": Field("EXITCODE", 8, exit_code, True, "exit code:signal, as sacct"),
        "oom": Field("OOM", 3, lambda r: "yes" if r.get("oom") else "no",
                     help="the OOM killer took a process of the step"),
        "submit": Field("SUBMIT", 19, lambda r: local(parse_stamp(r.get("submitted_at"))),
                        help="submit time (local)"),
        "start": Field("START", 19, lambda r: local(parse_stamp(r.get("started_at"))),
                       help="start time (local)"),
        "end": Field("END", 19, lambda r: local(parse_stamp(r.get("ended_at"))),
                     help="end time (local)"),
        "elapsed": Field("ELAPSED", 10, lambda r: duration(r.get("elapsed")), True,
                         "run time, suspensions left out, [D-][H:]M:SS"),
        "limit": Field("LIMIT", 10, lambda r: duration(r.get("time_limit")), True,
                       "time limit"),
        "ntasks": Field("TASKS", 5, lambda r: text(r.get("ntasks")), True, "tasks"),
        "cpus": Field("CPUS", 5, lambda r: text(r.get("cpus")), True, "CPUs, all tasks"),
        "gpus": Field("GPUS", 4, lambda r: text(r.get("gpus")), True, "GPUs"),
        "reqmem": Field("REQMEM", 7, lambda r: memory((r.get("memory_mb") or 0) * 1024, unit)
                        if r.get("memory_mb") else "", True, "memory asked for (0: none)"),
        "usercpu": Field("USERCPU", 10, lambda r: cpu_time(r.get("cpu_user")), True,
                         "CPU time in user mode, every process of the step"),
        "systemcpu": Field("SYSTEMCPU", 10, lambda r: cpu_time(r.get("cpu_system")), True,
                           "CPU time in system mode"),
        "totalcpu": Field("TOTALCPU", 10, lambda r: cpu_time(r.get("cpu_total")), True,
                          "user and system CPU time"),
        "maxrss": Field("MAXRSS", 10, mem("maxrss_kb"), True,
                        "the step's memory peak (its cgroup's; else its largest task's)"),
        "taskmaxrss": Field("TASKMAXRSS", 10, mem("task_maxrss_kb"), True,
                            "the largest peak resident set of one task (rusage)"),
        "attempts": Field("TRY", 3, lambda r: text(r.get("attempts")), True, "attempts"),
        "node": Field("NODE", 10, lambda r: text(r.get("node")), help="the node it ran on"),
    }


DEFAULT_FORMAT = "id,name,user,state,exitcode,start,elapsed,cpus,totalcpu,maxrss"


def fields_help() -> str:
    return "fields for --format (NAME or NAME:WIDTH, comma-separated):\n" + "\n".join(
        f"  {name:<11}{f.help}" for name, f in fields("K").items()) + \
        f"\ndefault: {DEFAULT_FORMAT}"


def parse_format(spec: str, unit: str) -> list[tuple[Field, int]]:
    table = fields(unit)
    cols: list[tuple[Field, int]] = []
    for item in spec.split(","):
        name, _, width = item.strip().lower().partition(":")
        if name not in table:
            raise CliError(f"acct: unknown field {name!r} in --format (fields: "
                           f"{', '.join(table)})", EXIT_USAGE)
        if width and not (width.isdigit() and 0 < int(width) <= 1000):
            raise CliError(f"acct: width {width!r} of {name!r} is not a number from 1 to 1000",
                           EXIT_USAGE)
        cols.append((table[name], int(width) if width else table[name].width))
    return cols


def request(ns: argparse.Namespace) -> dict[str, Any]:
    """The filters as the agent's ``acct`` takes them."""
    args: dict[str, Any] = {}
    refs = [*(ns.jobs or []), *(ns.job_list or [])]
    if refs:
        args["jobs"] = [[int(job), int(index) if index else None]
                        for job, _, index in (r.partition("_") for r in refs)]
    if ns.user is not None:
        args["users"] = sorted(ns.user)
    elif not (ns.all_users or refs or os.getuid() == 0):
        args["mine"] = True  # sacct's default: your own jobs
    if ns.state is not None:
        args["states"] = sorted(ns.state)
    if ns.name is not None:
        args["names"] = sorted(ns.name)
    if ns.since is not None:
        args["since"] = ns.since
    if ns.until is not None:
        args["until"] = ns.until
    return args


def acct(layout: Layout, ns: argparse.Namespace) -> int:
    unit = ns.units or "K"
    cols = parse_format(ns.format or DEFAULT_FORMAT, unit)
    args = request(ns)
    records: list[dict[str, Any]] = []
    while True:
        page = agent_call(layout, "acct", dict(args, after=records[-1]["id"] if records else 0))
        records.extend(page["jobs"])
        if not page["more"]:
            break
    if ns.json:
        from tether.cli.jsonout import dumps

        print(dumps(records))
        return 0
    if ns.parsable or ns.parsable2:
        end = "|" if ns.parsable else ""
        rows = [[f.header for f, _ in cols]] if not ns.no_header else []
        rows += [[f.get(r) for f, _ in cols] for r in records]
        for row in rows:
            say("|".join(v.replace("\n", " ") for v in row) + end)
        return 0
    for line in render(records, cols, header=not ns.no_header):
        say(line)
    return 0
