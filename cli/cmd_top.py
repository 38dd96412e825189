"""``top``: a live full-screen view of the node, refreshed every second (made with rich).

What it shows: the agent's node and allocations; the running jobs with their CPU use (percent
of one CPU over the last refresh, from the supervisor's ``stats``, as ``inspect --stats``) and
memory; the pending jobs with why they wait; the last jobs to end. The agent may be down or
restarting: the view says so and keeps trying. On a terminal it takes the whole screen until
q or Ctrl-C (or ``--iterations``); elsewhere it prints one plain snapshot per refresh. Names,
users, commands and reasons are the jobs' own: shown as plain text, escaped (``text``).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tether.cli.connect import agent_call, all_jobs, open_step, supervisor_errors
from tether.cli.errors import CliError
from tether.cli.format import fmt_exit
from tether.cli.table import elapsed, label
from tether.shared.errors import TetherError
from tether.shared.paths import Layout
from tether.shared.text import printable

#: running jobs whose supervisors are asked for stats on each refresh (the rest are listed)
MAX_PROBED = 32
ENDED_SHOWN = 5


@dataclass
class Sample:
    cpu: float
    at: float


@dataclass
class Snapshot:
    status: dict[str, Any] | None
    error: str | None
    running: list[dict[str, Any]] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)
    ended: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[int, dict[str, Any]] = field(default_factory=dict)


class Watcher:
    """Collects one snapshot per refresh; remembers CPU time to turn it into a rate."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.samples: dict[int, Sample] = {}

    def snapshot(self) -> Snapshot:
        try:
            status = agent_call(self.layout, "status", timeout=2.0)
            # this node's own runs, where its agent is a cluster's member too
            jobs = all_jobs(self.layout, local=os.path.exists(self.layout.cluster_marker))
        except (CliError, TetherError) as exc:
            return Snapshot(None, str(exc))
        snap = Snapshot(status, None)
        for j in jobs:
            if j["state"] in ("starting", "running", "suspended"):
                snap.running.append(j)
            elif j["state"] == "pending":
                snap.pending.append(j)
            else:
                snap.ended.append(j)
        snap.ended = snap.ended[-ENDED_SHOWN:]
        for j in snap.running[:MAX_PROBED]:
            stats = self.stats(j["id"])
            if stats is not None:
                snap.stats[j["id"]] = stats
        self.samples = {k: v for k, v in self.samples.items() if k in snap.stats}
        return snap

    def stats(self, job: int) -> dict[str, Any] | None:
        """The step's totals, with ``cpu_pct`` since the last refresh; None if unreachable."""
        try:
            with open_step(self.layout, job) as step, supervisor_errors(job):
                total: dict[str, Any] = dict(step.stats()["total"])
        except (CliError, TetherError):
            return None
        now = time.monotonic()
        cpu = float(total["cpu_user"]) + float(total["cpu_system"])
        before = self.samples.get(job)
        self.samples[job] = Sample(cpu, now)
        if before is not None and now > before.at:
            total["cpu_pct"] = max(0.0, 100.0 * (cpu - before.cpu) / (now - before.at))
        return total


def mib(kb: Any) -> str:
    return "" if kb is None else f"{int(kb) / 1024:.1f}"


def text(value: Any, style: str = "") -> Any:
    """A cell of text from a job, a user or a daemon: a rich ``Text``, so never read as markup
    (a name like ``[/x]`` would end a style that never began: rich raises) nor as emoji codes,
    and with control characters escaped (``printable``), so none reaches the terminal."""
    from rich.text import Text

    return Text(printable("" if value is None else value), style=style)


def render(snap: Snapshot, interval: float) -> Any:
    from rich.console import Group
    from rich.table import Table

    clock = time.strftime("%H:%M:%S")
    if snap.status is None:
        return Group(text(f"tether top  {clock}", "bold"),
                     text(f"{snap.error}; trying again every {interval:g}s", "red"))
    st = snap.status
    head = text(f"tether top  {clock}  node {st['node']}  agent {st['version']} "
                f"(pid {st['pid']})", "bold")
    alloc = Table.grid(padding=(0, 2))
    for res, unit in (("cpus", "CPUs"), ("gpus", "GPUs"), ("memory_mb", "MiB memory")):
        used, total = st[res]["allocated"], st[res]["total"]
        alloc.add_row(text(f"{used}/{total} {unit} allocated"), bar(used, total))

    running = Table(title=f"running ({len(snap.running)})", title_justify="left",
                    expand=True, header_style="bold")
    for col, right in (("ID", True), ("USER", False), ("NAME", False), ("CPUS", True),
                       ("CPU%", True), ("RSS MiB", True), ("PEAK MiB", True),
                       ("ELAPSED", True)):
        running.add_column(col, justify="right" if right else "left", no_wrap=True,
                           overflow="ellipsis")
    for j in snap.running:
        s = snap.stats.get(j["id"], {})
        pct = s.get("cpu_pct")
        running.add_row(*map(text, (label(j), j.get("user"), j["name"],
                                    str(len(j.get("cpus") or [])),
                                    "" if pct is None else f"{pct:.0f}", mib(s.get("rss_kb")),
                                    mib(s.get("peak_rss_kb")), elapsed(j))))

    pending = Table(title=f"pending ({len(snap.pending)})", title_justify="left", expand=True,
                    header_style="bold")
    for col in ("ID", "USER", "NAME", "CPUS", "REASON"):
        pending.add_column(col, justify="right" if col in ("ID", "CPUS") else "left",
                           no_wrap=True, overflow="ellipsis")
    for j in snap.pending:
        pending.add_row(*map(text, (label(j), j.get("user"), j["name"],
                                    str(j["cpus_per_task"] * j["ntasks"]), j.get("reason"))))

    ended = Table(title=f"ended (last {ENDED_SHOWN})", title_justify="left",
                  expand=True, header_style="bold")
    for col in ("ID", "NAME", "STATE", "EXIT", "ELAPSED"):
        ended.add_column(col, no_wrap=True, overflow="ellipsis")
    for j in reversed(snap.ended):
        ended.add_row(*map(text, (label(j), j["name"], j["state"], fmt_exit(j), elapsed(j))))
    return Group(head, alloc, running, pending, ended,
                 text(f"refreshed every {interval:g}s; q or Ctrl-C quits", "dim"))


def bar(used: int, total: int, width: int = 30) -> Any:
    from rich.text import Text

    filled = 0 if total <= 0 else round(width * min(used, total) / total)
    return Text("[" + "#" * filled + "." * (width - filled) + "]",
                style="green" if filled < width else "yellow")


def top(layout: Layout, ns: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    watcher = Watcher(layout)
    count = 0
    if not console.is_terminal:  # a pipe or a file: plain snapshots, no screen control
        while ns.iterations is None or count < ns.iterations:
            if count:
                time.sleep(ns.interval)
            console.print(render(watcher.snapshot(), ns.interval))
            count += 1
        return 0
    try:
        with keys() as pressed, Live(render(watcher.snapshot(), ns.interval), console=console,
                                     screen=True, auto_refresh=False) as live:
            count = 1
            while ns.iterations is None or count < ns.iterations:
                if pressed(ns.interval) in ("q", "Q"):
                    break
                live.update(render(watcher.snapshot(), ns.interval), refresh=True)
                count += 1
    except KeyboardInterrupt:
        pass  # the way out of a live view: not an error
    return 0


@contextmanager
def keys() -> Iterator[Callable[[float], str]]:
    """Keys typed while the view is up, one at a time without Enter (stdin in cbreak mode,
    restored on the way out); waiting for one is the refresh's sleep."""
    import select
    import sys
    import termios
    import tty

    fd = sys.stdin.fileno()
    try:
        saved = termios.tcgetattr(fd)
    except (termios.error, OSError):  # stdin is not a terminal: no keys, just the clock
        def wait(timeout: float) -> str:
            time.sleep(timeout)
            return ""
        yield wait
        return

    def read(timeout: float) -> str:
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 1).decode(errors="replace") if ready else ""
    tty.setcbreak(fd)
    try:
        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
