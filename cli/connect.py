"""How the CLI reaches the agent and a job's supervisor, with failures as one CLI error line."""

from __future__ import annotations

import os
import time

import tether
from tether.cli.errors import CliError
from tether.shared import protocol
from tether.shared.client import Client, NotListening, probe_unix
from tether.shared.errors import RemoteError, TetherError, Unreachable

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    from typing import Any

    from tether.shared.paths import Layout
    from tether.shared.step_client import StepClient

#: Arguments an agent of tether 0.1 does not know; left out when the door turns out to be one.
NEWER_ARGS = ("umask",)


def agent_call(layout: Layout, kind: str, args: dict[str, Any] | None = None,
               timeout: float = 10.0) -> Any:
    # Only a request that may safely be sent again takes the connection a previous call left
    # open (submit --wait's wait): it may have died with a restarted agent meanwhile.
    client = _open.pop(layout.sock, None) if kind in _RESENDABLE else None
    reused = client is not None
    if client is None:
        client = Client(layout.sock, timeout=timeout)
        try:
            client.connect()
        except NotListening as exc:
            raise CliError(f"no agent is answering at {layout.sock} ({exc.why})") from None
    watch = None
    if timeout > 5.0:  # a long poll: notice an agent that dies while holding it
        watch = AgentWatch(layout.sock)
    ok = False
    try:
        try:
            try:
                res = client.call(kind, args or {}, timeout=timeout, watch=watch)
            except RemoteError as exc:
                older = {k: v for k, v in (args or {}).items() if k not in NEWER_ARGS}
                if client.legacy is None or exc.code != "bad_request" or older == args:
                    raise
                res = client.call(kind, older, timeout=timeout, watch=watch)  # a 0.1 agent
            ok = True
            return res
        except Unreachable as exc:
            if reused:
                client.close()
                return agent_call(layout, kind, args, timeout)  # on a fresh connection
            raise CliError(f"the agent did not answer: {exc.message}") from None
        except RemoteError as exc:
            ok = True  # an answer: the connection is fine
            if exc.code in ("unknown_kind", "version") or (
                    exc.code == "bad_request" and "unknown arguments" in exc.message):
                raise CliError(skew_message(client, kind, exc)) from None
            raise
    finally:
        if ok and client.legacy is None:
            _open[layout.sock] = client  # the next call of this run (submit --wait) reuses it
        else:
            client.close()


#: this process's open connection to each agent, kept between calls (``agent_call``)
_open: dict[str, Client] = {}
#: the requests that take a kept connection: answering twice changes nothing
_RESENDABLE = ("wait", "show")


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


class AgentWatch:
    """Raises once the agent a request went to is gone: its socket file was removed or
    replaced (a restarted agent binds a new one), or nobody accepts on it any more. A request
    parked in a dead agent is never answered; the caller asks again at once instead of
    waiting out its deadline."""

    PROBE_EVERY = 1.0

    def __init__(self, path: str) -> None:
        self.path = path
        self.inode = _inode(path)
        self.probed = time.monotonic()

    def __call__(self) -> None:
        if _inode(self.path) != self.inode:
            raise CliError(f"the agent at {self.path} went away (its socket was replaced)")
        if time.monotonic() - self.probed >= self.PROBE_EVERY:
            self.probed = time.monotonic()
            why = probe_unix(self.path)
            if why is not None:
                raise CliError(f"the agent at {self.path} went away ({why})")


def _inode(path: str) -> tuple[int, int, int] | None:
    """Which file is at ``path``: inode numbers are reused at once, creation times are not."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def all_jobs(layout: Layout, local: bool = False) -> list[dict[str, Any]]:
    """Every job the agent holds, oldest first: it answers in pages so no reply outgrows a frame.
    ``local``: the node's own, where the agent is a cluster's member (whose ``list`` is the
    cluster's otherwise)."""
    jobs: list[dict[str, Any]] = []
    while True:
        args: dict[str, Any] = {"after": jobs[-1]["id"] if jobs else 0}
        if local:
            args["local"] = True
        page = agent_call(layout, "list", args)
        jobs.extend(page["jobs"])
        if not page["more"]:
            return jobs


class supervisor_errors:  # named as the function it was: ``with supervisor_errors(job):``
    """A vanished or silent supervisor as one CLI error line. A class, not contextlib's
    decorator: contextlib (collections, functools) is ~1.5 ms of every ``inspect``."""

    def __init__(self, job: int) -> None:
        self.job = job

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        if exc is None:
            return
        from tether.shared.step_client import SupervisorGone

        if isinstance(exc, SupervisorGone):
            raise CliError(exc.message) from None
        if isinstance(exc, Unreachable):
            raise CliError(f"job {self.job}: {exc.message}") from None


def open_step(layout: Layout, job: int) -> StepClient:
    if _relay is not None and _relay[1] == job:  # a cluster job on another node
        from tether.shared.step_client import RelayedStep

        relay_layout, _, node = _relay
        step = RelayedStep(job, node, lambda kind, args, timeout: agent_call(
            relay_layout, kind, args, timeout=timeout))
        with supervisor_errors(job):
            step.handshake()
        return step
    from tether.shared.step_client import connect

    with supervisor_errors(job):
        return connect(job, state_dir=layout.state_dir, timeout=5.0)


#: (the local agent's layout, the cluster job, its node): this command's step is on another
#: node and is reached through the agent (``relay_to``)
_relay: tuple[Layout, int, str] | None = None


def relay_to(layout: Layout, job: int, node: str) -> None:
    """This command's job runs on another node: ``open_step`` reaches it through the agent."""
    global _relay
    _relay = (layout, job, node)


def job_id_of(layout: Layout, ref: str | int) -> int:
    """The job id of ``ID`` or ``ARRAY_INDEX``: an element is looked up in the agent (the
    supervisor's run directory is named by the element's own id)."""
    if isinstance(ref, int):  # a cluster job's, resolved already
        return ref
    job, _, index = ref.partition("_")
    if not index:
        return int(job)
    return int(agent_call(layout, "show", {"job": int(job), "index": int(index)})["id"])
