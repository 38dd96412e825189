"""A client for one job step's supervisor, for tools that inspect, follow or signal a step.

It talks to the supervisor directly (never through the agent), so it works while the agent is
down or restarting. ``docs/client.md`` is the reference; a short example::

    from tether.shared.step_client import SupervisorGone, connect

    try:
        with connect(42) as step:
            print(step.state()["state"])
            for stream, data in step.follow_output():
                ...  # every byte of the step's output, once, until the step ends
    except SupervisorGone as exc:
        print(exc.message)

Every call has a deadline (``timeout``; long polls add their ``hold``). While a long poll
waits, the supervisor process is watched through /proc, so one that dies mid-call raises
``SupervisorGone`` within a fraction of a second rather than at the deadline.
"""

from __future__ import annotations

import os
import time

from tether.shared.client import Client, NotListening, probe_unix
from tether.shared.errors import RemoteError, TetherError, Unreachable, VersionMismatch
from tether.shared.paths import Layout, default_state_dir
from tether.shared.procid import ProcId

# What only some calls need, they import: re, signal, socket, pwd and contextlib (and the enum
# and collections they pull in) were ~5 ms of every ``tether inspect``.
TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

__all__ = ["StepClient", "SupervisorGone", "connect", "find_socket", "parse_signal"]

#: How many attempt numbers are tried when the run directory cannot be listed (mode 0711).
MAX_ATTEMPT_PROBE = 100
#: Default seconds a long poll (follow, events) may be held open by the supervisor.
DEFAULT_HOLD = 10.0
#: how long one ``hello`` may take while a re-executing supervisor comes back
UPGRADE_PROBE = 1.0
_CHUNK = 1 << 16


class SupervisorGone(TetherError):
    """There is no live supervisor for the job (never was on this node, or it went away)."""

    code = "gone"


def find_socket(job: int, state_dir: str | None = None) -> str:
    """The socket of the job's newest attempt on this node (it may be stale: see connect)."""
    layout = Layout(os.path.abspath(state_dir or default_state_dir()))
    attempts: list[int] = []
    prefix = f"{job}."
    try:
        names = os.listdir(layout.run_root)
    except PermissionError:  # run/ may be 0711: try the attempt numbers instead
        names = [f"{job}.{a}" for a in range(1, MAX_ATTEMPT_PROBE + 1)
                 if os.path.exists(layout.run_dir(job, a).path)]
    except FileNotFoundError:
        names = []
    for name in names:
        # JOB.ATTEMPT, ATTEMPT as [1-9][0-9]{0,9} (a regular expression would cost ``re``)
        attempt = name[len(prefix):] if name.startswith(prefix) else ""
        if 0 < len(attempt) <= 10 and attempt[0] != "0" and attempt.isascii() \
                and attempt.isdigit():
            attempts.append(int(attempt))
    if not attempts:
        raise SupervisorGone(f"job {job} has no supervisor on this node (not running, or "
                             "already collected: try 'tether show')")
    return layout.run_dir(job, max(attempts)).sock


def parse_signal(value: int | str) -> int:
    """A signal number from a number, or a name with or without ``SIG`` (any case), or
    ``RTMIN+N`` / ``RTMAX-N``. Raises ValueError naming the bad value."""
    import re
    import signal as _signal

    if isinstance(value, int) and not isinstance(value, bool):
        num = value
    else:
        text = str(value).strip()
        if re.fullmatch(r"[0-9]+", text):
            num = int(text)
        else:
            name = text.upper()
            if not name.startswith("SIG"):
                name = "SIG" + name
            m = re.fullmatch(r"SIGRT(MIN|MAX)([+-][0-9]+)?", name)
            if m:
                base = _signal.SIGRTMIN if m.group(1) == "MIN" else _signal.SIGRTMAX
                num = int(base) + int(m.group(2) or 0)
            else:
                try:
                    num = int(_signal.Signals[name])
                except KeyError:
                    raise ValueError(f"unknown signal {text!r}") from None
    if num not in {int(s) for s in _signal.valid_signals()}:
        raise ValueError(f"{value!r} is not a valid signal number")
    return num


class StepClient:
    """One connection to one step's supervisor. Use ``connect`` to make one."""

    def __init__(self, path: str, job: int, *, timeout: float = 5.0) -> None:
        self.path = path
        self.job = job
        self.timeout = timeout
        self.client = Client(path, timeout=timeout)
        #: the supervisor's identity, from ``hello``; None when it cannot be seen in /proc
        self.ident: ProcId | None = None
        self.hello: dict[str, Any] = {}
        #: follow_output's position in each stream: where a resumed follow starts
        self.offsets: dict[str, int] = {}
        #: the step's phase as the last follow or events reply said
        self.last_phase: str | None = None
        #: set when follow_output finished the files itself because the supervisor went away
        self.fell_back = False

    # ---- plumbing ------------------------------------------------------------------------------

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> StepClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _gone(self, why: str) -> SupervisorGone:
        return SupervisorGone(f"job {self.job}: its supervisor went away ({why})")

    def _alive(self) -> bool:
        if self.ident is not None:
            return self.ident.alive()
        return probe_unix(self.path) is None

    def _dying(self, within: float = 1.0) -> bool:
        """Is the supervisor gone, or going? A door's connection closes while its process is
        still exiting, before /proc shows it dead: give it ``within`` seconds to show it."""
        deadline = time.monotonic() + within
        while self._alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _watch(self) -> None:
        if not self._alive():
            raise self._gone("its process exited")

    def call(self, kind: str, args: dict[str, Any] | None = None, *,
             timeout: float | None = None) -> Any:
        """Send one request and return its result. Raises ``SupervisorGone`` if the supervisor
        dies meanwhile, ``RemoteError`` for an error reply and ``Unreachable`` if a live
        supervisor does not answer in time."""
        try:
            return self.client.call(kind, args, timeout=timeout, watch=self._watch)
        except VersionMismatch:  # sent nothing: its release has no such kind
            raise self._too_old(kind) from None
        except RemoteError as exc:
            if exc.code == "unknown_kind":  # a release older than the version table says
                raise self._too_old(kind) from None
            raise
        except Unreachable:
            if self._dying():
                raise self._gone("no reply, and it is no longer running") from None
            raise

    def _too_old(self, kind: str) -> VersionMismatch:
        return VersionMismatch(f"job {self.job}'s supervisor is {self.client.release or '?'} "
                               f"and does not answer {kind!r}")

    def handshake(self) -> dict[str, Any]:
        try:
            res = self.client.hello(timeout=None, watch=self._watch)
        except Unreachable:
            if self._dying():
                raise self._gone("no reply, and it is no longer running") from None
            raise
        self.hello = res
        try:
            ident = ProcId.from_dict(res)
        except ValueError:
            ident = None
        # Watch the process only if this user can see it in /proc (hidepid may hide it).
        self.ident = ident if ident is not None and ident.alive() else None
        return res

    # ---- verbs ---------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """``state``: the step's state, phase, live task pids and exit record (any user)."""
        res: dict[str, Any] = self.call("state")
        return res

    def info(self) -> dict[str, Any]:
        """``info``: command, owner, workdir, resources, output paths, versions."""
        res: dict[str, Any] = self.call("info")
        return res

    def pids(self) -> dict[str, Any]:
        """``pids``: every task (alive or its exit status) and every other step process."""
        res: dict[str, Any] = self.call("pids")
        return res

    def stats(self) -> dict[str, Any]:
        """``stats``: CPU seconds, current and peak RSS and elapsed time, per task and total."""
        res: dict[str, Any] = self.call("stats")
        return res

    def pmi(self) -> dict[str, Any]:
        res: dict[str, Any] = self.call("pmi")
        return res

    def output(self, lines: int = 10, stream: str = "both") -> dict[str, bytes]:
        """The last ``lines`` lines of each stream (``stdout``, ``stderr``; only ``stdout`` when
        both go to one file)."""
        res = self.call("output", {"stream": stream, "lines": lines})
        return {name: part["data"] for name, part in res.items()
                if name in ("stdout", "stderr")}

    def follow_output(self, stream: str = "both", *, offsets: dict[str, int] | None = None,
                      hold: float = DEFAULT_HOLD,
                      fallback: bool = True) -> Iterator[tuple[str, bytes]]:
        """Yield ``(stream, bytes)`` from ``offsets`` (default: the start) until the step has
        ended and everything was read. Every byte is yielded once; ``self.offsets`` is the
        position reached.

        With ``fallback``, a supervisor that goes away mid-follow (it exits shortly after the
        agent acknowledges the result) is not an error: the rest of the output files is read
        from the offsets reached, directly (as this user), and ``fell_back`` is set.
        """
        self.offsets = dict(offsets or {})
        self.fell_back = False
        paths: dict[str, str] = {}
        owner = os.geteuid()
        if fallback:
            from tether.shared import outpattern

            info = self.info()
            # the first task's files, as the supervisor's readers (outpattern)
            paths = {"stdout": outpattern.for_task(info["output"], 0),
                     "stderr": outpattern.for_task(info["error"], 0)}
            owner = int(info.get("uid", owner))
        while True:
            try:
                res = self.call("output", {"stream": stream, "offset": self.offsets,
                                           "hold": hold},
                                timeout=hold + self.timeout)
            except SupervisorGone:
                if not fallback:
                    raise
                if stream != "both":
                    names = [stream]
                elif paths["stdout"] == paths["stderr"]:
                    names = ["stdout"]
                else:
                    names = ["stdout", "stderr"]
                yield from self._finish_from_files(paths, names, owner)
                return
            self.last_phase = res.get("phase")
            for name in ("stdout", "stderr"):
                part = res.get(name)
                if part is None:
                    continue
                self.offsets[name] = int(part["offset"])
                if part["data"]:
                    yield name, bytes(part["data"])
            if res["ended"]:
                return
            if res.get("upgrading"):
                self.await_new_image()

    def await_new_image(self, deadline: float = 30.0) -> dict[str, Any]:
        """The supervisor said it is re-executing (``upgrade``): wait until its new image
        answers ``hello`` (a later generation, same process), each try on a fresh connection,
        so that no request goes into the closing one. Returns the new hello."""
        before = int(self.hello.get("generation", 0))
        give_up = time.monotonic() + deadline
        while True:
            res = self._hello_again()
            if int(res.get("generation", before)) > before:
                self.hello = res
                return res
            if time.monotonic() > give_up:
                raise Unreachable(f"job {self.job}: its supervisor did not come back after "
                                  f"re-executing within {deadline:g}s")
            time.sleep(UPGRADE_PROBE / 4)

    def _hello_again(self) -> dict[str, Any]:
        """One ``hello`` on a fresh connection; {} if none came in time."""
        self.client.close()
        try:
            res: dict[str, Any] = self.client.hello(timeout=UPGRADE_PROBE, watch=self._watch)
        except Unreachable:
            return {}
        return res

    def _finish_from_files(self, paths: dict[str, str], names: list[str],
                           owner: int) -> Iterator[tuple[str, bytes]]:
        from tether.shared.as_owner import open_as_reader

        self.fell_back = True
        for name in names:
            try:
                fd = open_as_reader(paths[name], owner)
            except (OSError, KeyError) as exc:
                raise self._gone(f"and its {name} file cannot be read: {exc}") from None
            try:
                off = self.offsets.get(name, 0)
                while data := os.pread(fd, _CHUNK, off):
                    off += len(data)
                    self.offsets[name] = off
                    yield name, data
            finally:
                os.close(fd)

    def events(self, after: int = 0, *, hold: float = DEFAULT_HOLD) -> Iterator[dict[str, Any]]:
        """Yield the step's events (``seq`` > ``after``) as they happen, until the step ended."""
        while True:
            res = self.call("events", {"after": after, "hold": hold},
                            timeout=hold + self.timeout)
            yield from res["events"]
            after = int(res["last"])
            if res["ended"]:
                return
            if res.get("upgrading"):
                self.await_new_image()

    def signal(self, sig: int | str, rank: int | None = None) -> dict[str, Any]:
        """Send ``sig`` (number or name) to one task's process group, or to every live task's.
        Returns ``{"signal", "name", "ranks"}``."""
        args: dict[str, Any] = {"signal": parse_signal(sig)}
        if rank is not None:
            args["rank"] = rank
        res: dict[str, Any] = self.call("signal", args)
        return res


def connect(job: int, *, state_dir: str | None = None, timeout: float = 5.0) -> StepClient:
    """Connect to the supervisor of ``job``'s newest attempt under ``state_dir`` (default: as
    the CLI's) and shake hands. Raises ``SupervisorGone`` when there is no live supervisor."""
    path = find_socket(job, state_dir)
    step = StepClient(path, job, timeout=timeout)
    try:
        try:
            step.client.connect()
        except NotListening as exc:
            raise SupervisorGone(f"job {job}: its supervisor is not answering at {path} "
                                 f"({exc.why})") from None
        step.handshake()
    except BaseException:
        step.close()
        raise
    return step


class RelayedStep(StepClient):
    """A cluster job's step on another node, reached through this node's agent, which asks that
    node through the cluster's database (``agent/cluster_relay.py``): the same verbs as a
    ``StepClient``, each one request of the agent's ``relay``. ``call_agent(kind, args,
    timeout)`` is the caller's way to its agent (the CLI's ``agent_call``)."""

    def __init__(self, job: int, node: str, call_agent: Any, *, timeout: float = 5.0) -> None:
        super().__init__(f"node {node}", job, timeout=timeout)
        self.node = node
        self.call_agent = call_agent

    def close(self) -> None:
        return None

    def _alive(self) -> bool:
        return True  # its node's agent says when it is gone ("gone")

    def call(self, kind: str, args: dict[str, Any] | None = None, *,
             timeout: float | None = None) -> Any:
        try:
            return self.call_agent("relay", {"job": self.job, "kind": kind, "args": args or {}},
                                   (timeout or self.timeout) + 15.0)
        except RemoteError as exc:
            if exc.code == "gone":
                raise SupervisorGone(exc.message) from None
            raise

    def handshake(self) -> dict[str, Any]:
        self.hello = self.call("hello")
        return self.hello

    def _hello_again(self) -> dict[str, Any]:
        try:
            res: dict[str, Any] = self.call("hello")
        except TetherError:
            return {}
        return res
