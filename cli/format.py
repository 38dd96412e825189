"""Text shapes shared by verbs: exit columns, key/value blocks."""

from __future__ import annotations

from tether.cli.errors import EXIT_ERROR
from tether.shared.text import printable

TYPE_CHECKING = False  # typing (and collections) cost every CLI run ~2 ms: type checker only
if TYPE_CHECKING:
    from collections.abc import Iterable
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
    """What ``wait`` exits with: the job's code, 128+N for signal N, 1 when it has neither.
    A job that ran out of time never exits 0 (its tasks may have caught the SIGTERM)."""
    if job.get("signal") is not None:
        return 128 + int(job["signal"])
    if job.get("exit_code") is not None and (job["exit_code"] or job["state"] != "timeout"):
        return int(job["exit_code"])
    return 0 if job["state"] == "completed" else EXIT_ERROR


def print_pairs(rows: Iterable[tuple[str, Any]]) -> None:
    """One ``key value`` line per row; lists joined by spaces, None as empty."""
    for key, value in rows:
        if isinstance(value, list):
            value = " ".join(str(v) for v in value)
        say(f"{key:<15}{'' if value is None else value}")


JOB_FIELDS = ("id", "name", "state", "attempt", "exit_code", "signal", "reason", "priority",
              "time_limit",
              "dependency", "begin_at", "command", "pmi",
              "ntasks", "cpus", "gpus", "memory_mb", "supervisor_pid", "pids", "workdir",
              "output", "error", "submitted_at", "started_at", "ended_at")


def print_job(job: dict[str, Any]) -> None:
    def value(key: str) -> Any:
        if key == "id" and job.get("array_id") is not None:
            return f"{job['array_id']}_{job['array_index']} (job {job['id']})"
        if key == "time_limit" and job.get(key) is not None:
            from tether.shared.jobopts import format_time

            return format_time(job[key])
        if key == "state" and job.get("held") and job["state"] == "pending":
            return "pending (held)"
        if key == "pmi" and job.get("pmi_unused"):
            return f"{job['pmi']}, unused: no rank spoke PMI (each ran alone; docs/pmi.md)"
        return job.get(key)
    # the PMI line only for the jobs that asked for PMI
    print_pairs((key, value(key)) for key in JOB_FIELDS
                if (key != "pmi" or job.get("pmi") not in (None, "none"))
                and (key != "priority" or job.get("priority") is not None))
