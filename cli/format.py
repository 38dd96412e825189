"""Text shapes shared by verbs: exit columns, key/value blocks."""

from __future__ import annotations

from collections.abc import Iterable

from tether.cli.errors import EXIT_ERROR
from tether.shared.text import printable

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    from typing import Any


def say(*values: object, file: Any = None, flush: bool = False) -> None:
    """``print`` for text that jobs or peers control (names, commands, process titles, reasons,
    error messages): control characters are shown escaped, never sent to the terminal."""
    print(*(printable(v) for v in values), file=file, flush=flush)


def fmt_exit(job: dict[str, Any]) -> str:
    if job.get("signal") is not None:
        return f"sig{job['signal']}"
    if job.get("exit_code") is not None:
        return str(job["exit_code"])
    return "-"


def exit_status(job: dict[str, Any]) -> int:
    """What ``wait`` exits with: the job's code, 128+N for signal N, 1 when it has neither."""
    if job.get("signal") is not None:
        return 128 + int(job["signal"])
    if job.get("exit_code") is not None:
        return int(job["exit_code"])
    return 0 if job["state"] == "completed" else EXIT_ERROR


def print_pairs(rows: Iterable[tuple[str, Any]]) -> None:
    """One ``key value`` line per row; lists joined by spaces, None as empty."""
    for key, value in rows:
        if isinstance(value, list):
            value = " ".join(str(v) for v in value)
        say(f"{key:<15}{'' if value is None else value}")


JOB_FIELDS = ("id", "name", "state", "attempt", "exit_code", "signal", "reason", "command",
              "ntasks", "cpus", "gpus", "memory_mb", "supervisor_pid", "pids", "workdir",
              "output", "error", "submitted_at", "started_at", "ended_at")


def print_job(job: dict[str, Any]) -> None:
    print_pairs((key, job.get(key)) for key in JOB_FIELDS)
