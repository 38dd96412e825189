"""How the CLI reaches the agent and a job's supervisor, with failures as one CLI error line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tether.cli.errors import CliError
from tether.shared.client import Client, probe_unix
from tether.shared.errors import RemoteError, Unreachable
from tether.shared.paths import Layout
from tether.shared.step_client import StepClient, SupervisorGone, connect

#: Arguments an agent of tether 0.1 does not know; left out when the door turns out to be one.
NEWER_ARGS = ("umask",)


def agent_call(layout: Layout, kind: str, args: dict[str, Any] | None = None,
               timeout: float = 10.0) -> Any:
    why = probe_unix(layout.sock)
    if why is not None:
        raise CliError(f"no agent is answering at {layout.sock} ({why})")
    with Client(layout.sock, timeout=timeout) as client:
        try:
            try:
                return client.call(kind, args or {})
            except RemoteError as exc:
                older = {k: v for k, v in (args or {}).items() if k not in NEWER_ARGS}
                if client.legacy is None or exc.code != "bad_request" or older == args:
                    raise
                return client.call(kind, older)  # a 0.1 agent: what it knows, nothing lost
        except Unreachable as exc:
            raise CliError(f"the agent did not answer: {exc.message}") from None


def all_jobs(layout: Layout) -> list[dict[str, Any]]:
    """Every job the agent holds, oldest first: it answers in pages so no reply outgrows a frame."""
    jobs: list[dict[str, Any]] = []
    while True:
        page = agent_call(layout, "list", {"after": jobs[-1]["id"] if jobs else 0})
        jobs.extend(page["jobs"])
        if not page["more"]:
            return jobs


@contextmanager
def supervisor_errors(job: int) -> Iterator[None]:
    """A vanished or silent supervisor as one CLI error line."""
    try:
        yield
    except SupervisorGone as exc:
        raise CliError(exc.message) from None
    except Unreachable as exc:
        raise CliError(f"job {job}: {exc.message}") from None


def open_step(layout: Layout, job: int) -> StepClient:
    with supervisor_errors(job):
        return connect(job, state_dir=layout.state_dir, timeout=5.0)
