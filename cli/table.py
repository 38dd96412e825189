"""The job table of ``list`` (and ``top``): named fields, fixed widths, one line per job.

Every column has a fixed width (``FIELDS``, or ``NAME:WIDTH`` in ``--format``); a longer value
is cut and ends in ``+`` so that the columns after it stay in place. The last column is never
cut. Imports nothing that talks to anyone: the parser reads ``fields_help`` for ``--help``.
"""

from __future__ import annotations

import time

from tether.cli.errors import EXIT_USAGE, CliError
from tether.cli.format import fmt_exit
from tether.cli.timefmt import duration, local, parse_stamp
from tether.shared.frozen import Frozen

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def label(j: dict[str, Any]) -> str:
    """``ID``, or Slurm's ``ARRAY_INDEX`` for an element of an array."""
    if j.get("array_id") is not None:
        return f"{j['array_id']}_{j.get('array_index')}"
    return str(j["id"])


def elapsed(j: dict[str, Any]) -> str:
    start = parse_stamp(j.get("started_at"))
    if start is None:
        return ""
    end = parse_stamp(j.get("ended_at"))
    # time spent suspended is not run time (Slurm's elapsed leaves it out too)
    frozen = float(j.get("suspended_seconds") or 0)
    return duration(max(0.0, (time.time() if end is None else end) - start - frozen))


def limit(j: dict[str, Any]) -> str:
    return "" if j.get("time_limit") is None else duration(j["time_limit"])


def text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


class Field(Frozen):
    """One column. Not a dataclass: dataclasses imports inspect, ~6 ms of every ``list``."""

    __slots__ = ("header", "width", "get", "right", "help")
    header: str
    width: int
    get: Callable[[dict[str, Any]], str]
    right: bool
    help: str

    def __init__(self, header: str, width: int, get: Callable[[dict[str, Any]], str],
                 right: bool = False, help: str = "") -> None:
        self._init(header=header, width=width, get=get, right=right, help=help)


def key(name: str) -> Callable[[dict[str, Any]], str]:
    return lambda j: text(j.get(name))


FIELDS: dict[str, Field] = {
    "id": Field("ID", 9, label, True, "job id (ARRAY_INDEX for an array element)"),
    "jobid": Field("JOBID", 7, key("id"), True, "the job's own id, also for array elements"),
    "user": Field("USER", 9, key("user"), help="who the tasks run as"),
    "name": Field("NAME", 16, key("name"), help="job name"),
    "state": Field("STATE", 10, key("state"), help="pending, running, completed, ..."),
    "exit": Field("EXIT", 5, fmt_exit, True, "exit code, sigN, or -"),
    "reason": Field("REASON", 22, key("reason"), help="why it is pending, or how it ended"),
    "priority": Field("PRIORITY", 8, key("priority"), True,
                      "a pending job's fair-share priority: the higher, the sooner (its user's "
                      "recent usage; 1000000: none)"),
    "submit": Field("SUBMIT", 19, lambda j: local(parse_stamp(j.get("submitted_at"))),
                    help="submit time (local)"),
    "start": Field("START", 19, lambda j: local(parse_stamp(j.get("started_at"))),
                   help="start time (local)"),
    "end": Field("END", 19, lambda j: local(parse_stamp(j.get("ended_at"))),
                 help="end time (local)"),
    "elapsed": Field("ELAPSED", 10, elapsed, True, "run time so far or in all, [D-][H:]M:SS"),
    "limit": Field("LIMIT", 10, limit, True, "time limit, [D-][H:]M:SS"),
    "ntasks": Field("TASKS", 5, key("ntasks"), True, "tasks"),
    "cpus": Field("CPUS", 5, lambda j: str(len(j.get("cpus") or [])
                                           or j["cpus_per_task"] * j["ntasks"]), True,
                  "CPUs, all tasks together"),
    "gpus": Field("GPUS", 4, lambda j: str(len(j.get("gpus") or [])), True, "GPUs allocated"),
    "memory": Field("MEM_MB", 7, key("memory_mb"), True, "memory, MiB"),
    "attempt": Field("TRY", 3, key("attempt"), True, "attempt number"),
    "node": Field("NODE", 10, key("node"), help="the node it runs or ran on (cluster jobs)"),
    "workdir": Field("WORKDIR", 24, key("workdir"), help="working directory"),
    "output": Field("OUTPUT", 24, key("output"), help="stdout file"),
    "error": Field("ERROR", 24, key("error"), help="stderr file"),
    "command": Field("COMMAND", 30, key("command"), help="command line"),
}
DEFAULT_FORMAT = "id,user,name,state,exit,start,elapsed,reason,command"
#: ``list --cluster``: the same with the node
CLUSTER_FORMAT = "id,user,name,state,node,exit,start,elapsed,reason,command"


def parse_format(spec: str) -> list[tuple[Field, int]]:
    """``name[:WIDTH],...`` into (field, width) pairs; a usage error names an unknown field."""
    cols: list[tuple[Field, int]] = []
    for item in spec.split(","):
        name, _, width = item.strip().lower().partition(":")
        if name not in FIELDS:
            raise CliError(f"list: unknown field {name!r} in --format (fields: "
                           f"{', '.join(FIELDS)})", EXIT_USAGE)
        if width and not (width.isdigit() and 0 < int(width) <= 1000):
            raise CliError(f"list: width {width!r} of {name!r} is not a number from 1 to 1000",
                           EXIT_USAGE)
        cols.append((FIELDS[name], int(width) if width else FIELDS[name].width))
    return cols


def cell(value: str, width: int, right: bool, last: bool) -> str:
    value = value.replace("\n", " ")
    if last:
        return value
    if len(value) > width:
        value = value[:width - 1] + "+"
    return value.rjust(width) if right else value.ljust(width)


def render(jobs: list[dict[str, Any]], cols: list[tuple[Field, int]], header: bool) -> list[str]:
    rows = [[(f.header, w, f.right) for f, w in cols]] if header else []
    rows += [[(f.get(j), w, f.right) for f, w in cols] for j in jobs]
    n = len(cols)
    return ["  ".join(cell(v, w, right, i == n - 1) for i, (v, w, right) in enumerate(r)).rstrip()
            for r in rows]


def fields_help() -> str:
    return "fields for --format (NAME or NAME:WIDTH, comma-separated):\n" + "\n".join(
        f"  {name:<9}{f.help}" for name, f in FIELDS.items()) + \
        f"\ndefault: {DEFAULT_FORMAT}"
