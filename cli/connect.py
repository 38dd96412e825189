"""How the CLI reaches the agent and a job's supervisor, with failures as one CLI error line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import tether
from tether.cli.errors import CliError
from tether.shared import protocol
from tether.shared.client import Client, probe_unix
from tether.shared.errors import RemoteError, TetherError, Unreachable
from tether.shared.paths import Layout
from tether.shared.step_client import StepClient, SupervisorGone, connect


def agent_call(layout: Layout, kind: str, args: dict[str, Any] | None = None,
               timeout: float = 10.0) -> Any:
    why = probe_unix(layout.sock)
    if why is not None:
        raise CliError(f"no agent is answering at {layout.sock} ({why})")
    with Client(layout.sock, timeout=timeout) as client:
        try:
            return client.call(kind, args or {})
        except Unreachable as exc:
            raise CliError(f"the agent did not answer: {exc.message}") from None
        except RemoteError as exc:
            if exc.code in ("unknown_kind", "version") or (
                    exc.code == "bad_request" and "unknown arguments" in exc.message):
                raise CliError(skew_message(client, kind, exc)) from None
            raise


def skew_message(client: Client, kind: str, exc: RemoteError) -> str:
    """One line naming both releases when the agent is of another release than this CLI."""
    try:
        client.hello(timeout=2.0)
    except TetherError:
        return exc.message
    if client.release == tether.__version__:
        return exc.message  # same release: a plain error, not skew
    mine = f"this CLI is tether {tether.__version__} (protocol {protocol.PROTOCOL_VERSION})"
    theirs = f"the agent is tether {client.release} (protocol {client.protocol})"
    if exc.code == "bad_request":
        return f"{theirs} and refuses {kind!r}: {exc.message}; {mine}"
    return f"{theirs} and does not answer {kind!r}; {mine}"


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
