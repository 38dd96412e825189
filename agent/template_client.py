"""The agent's side of the supervisor template (``supervisor/template.py``): keeping one running
this very code, knowing whether it can be used right now, and the wire of one spawn request.

Apart from ``spawn.py`` because it is about one long-lived process, not the spawns: the spawner
asks ``connect()`` for a connection before each warm spawn and falls back to a cold one when it
gets None; what it learns about the template along the way (no answer, a hang) comes back here
through ``failed()``, so the outage is said once in the log and the next start is paced.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

from tether.agent.spawn_cold import detach
from tether.agent.spawn_prep import SpawnError
from tether.shared import template_wire
from tether.shared.paths import Layout
from tether.shared.procid import ProcId
from tether.shared.template_wire import TemplateError

log = logging.getLogger("tether.agent")

#: How long a live template may take to answer; then it counts as broken and is killed.
TEMPLATE_TIMEOUT = 2.0
#: The least time between two starts of a template that died or hung.
TEMPLATE_RETRY = 2.0
#: How long a template stays once no agent runs (``agent --template-linger``): an agent
#: restarted within it (a crash, an upgrade of other code replaces it anyway) finds it warm.
TEMPLATE_LINGER = 300.0
#: A template just started needs a moment to import everything: cold spawns while it is alive
#: and younger than this are expected and not reported.
TEMPLATE_WARMUP = 5.0


class Template:
    """The agent's view of the supervisor template."""

    def __init__(self, layout: Layout, *, use: bool = True, ksm: bool = False,
                 linger: float = TEMPLATE_LINGER) -> None:
        self.layout = layout
        self.use = use
        #: how long the template stays once no agent runs (``agent --template-linger``)
        self.linger = linger
        #: why the template cannot be used right now (None: it can), said once per outage
        self.down: str | None = None
        self.started = -1e9
        self.ident: ProcId | None = None
        #: when the template last answered a request (it is busy, not hung, while this moves)
        self.answered = -1e9
        #: ``agent --ksm``: its supervisors mark the pages they hold alone mergeable (part of
        #: the template's identity: supervisor/ksm.py)
        self.ksm = ksm
        self.identity = template_wire.template_identity(ksm) if use else ""

    def ensure(self) -> None:
        """At agent start: keep a template running this very code, or start one (no wait)."""
        if not self.use:
            return
        if self.ksm:
            _check_ksmd()
        path = self.layout.template_sock
        hello = {"op": "hello", "agent_lock": self.layout.lock, "linger": self.linger}
        try:
            reply, ident = _call(path, hello, TEMPLATE_TIMEOUT)
        except FileNotFoundError:
            reply, ident = None, None
        except (OSError, TemplateError) as exc:
            log.warning("supervisor template on %s did not answer (%s); replacing it", path, exc)
            self.kill(_peer_ident(path))
            reply, ident = None, None
        if reply is not None and reply.get("identity") == self.identity:
            self.ident = ident
            log.info("supervisor template %s (pid %s) kept", self.identity, reply.get("pid"))
            return
        if reply is not None:
            log.info("supervisor template runs %s, not the installed %s: replacing it",
                     reply.get("identity"), self.identity)
            with contextlib.suppress(OSError, TemplateError):
                _call(path, {"op": "exit", "identity": self.identity}, TEMPLATE_TIMEOUT)
        self.start()

    def start(self) -> None:
        self.started = time.monotonic()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.layout.template_sock)  # never talk to a predecessor's leftover
        try:
            pid = detach([sys.executable, "-I", "-m", "tether.supervisor.template",
                          "--socket", self.layout.template_sock, "--agent-lock",
                          self.layout.lock, "--linger", repr(self.linger),
                          *(["--ksm"] if self.ksm else [])], self.layout, ())
        except (OSError, SpawnError) as exc:
            self.failed(f"cannot start it: {exc}")
            return
        self.ident = ProcId.of(pid)
        log.info("supervisor template starting (pid %d)", pid)

    def failed(self, why: str) -> None:
        if self.down is None:
            log.warning("supervisor template unavailable (%s): starting supervisors cold until "
                        "it is back", why)
        self.down = why

    def kill(self, ident: ProcId | None, sig: int = signal.SIGKILL) -> None:
        if ident is not None and ident.alive():
            with contextlib.suppress(OSError):
                os.kill(ident.pid, sig)

    def connect(self) -> socket.socket | None:
        """A connection to the template, or None (and why, once) to go cold."""
        if not self.use:
            return None
        now = time.monotonic()
        if self.down is not None and now - self.started > TEMPLATE_RETRY:
            self.start()
        conn = socket.socket(socket.AF_UNIX,
                             socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            conn.connect(self.layout.template_sock)
        except OSError as exc:
            conn.close()
            starting = (self.ident is not None and self.ident.alive()
                        and now - self.started < TEMPLATE_WARMUP)
            if not starting:  # (a template still importing is expected, not news)
                self.failed(exc.strerror or str(exc))
            return None
        if self.down is not None:
            log.info("supervisor template is back: supervisors start warm again")
            self.down = None
        return conn

    def stop(self) -> None:
        """The agent stops for good (``--stop-for-good``): the template goes too, asked to
        (it removes its socket); one that does not know ``stop`` (of another release) or does
        not answer gets SIGTERM, found by the socket's peer credentials (never by a pid that
        may have been reused)."""
        if not self.use:
            return
        path = self.layout.template_sock
        try:
            reply, ident = _call(path, {"op": "stop"}, TEMPLATE_TIMEOUT)
        except FileNotFoundError:
            return
        except (OSError, TemplateError):
            reply, ident = {}, _peer_ident(path)
        if reply.get("ok"):
            log.info("supervisor template (pid %s) asked to leave: the agent stops for good",
                     ident.pid if ident else "?")
            return
        if ident is not None and ident.alive():
            log.info("supervisor template (pid %d) sent SIGTERM: the agent stops for good",
                     ident.pid)
            self.kill(ident, signal.SIGTERM)

    def status(self) -> dict[str, Any]:
        """``status``'s ``template``: its pid while it lives (null otherwise), why it cannot be
        used right now (null: it can), and how long it stays once no agent runs."""
        pid = self.ident.pid if self.ident is not None and self.ident.alive() else None
        down = self.down if self.use else "not used (supervisors start cold)"
        return {"pid": pid, "down": down, "linger": self.linger}


def read_pid(data: bytes) -> int:
    """The pid in the template's reply to a spawn request, or ``TemplateError``."""
    reply = template_wire.decode(data)
    if not reply.get("ok") or not isinstance(reply.get("pid"), int):
        raise TemplateError(str(reply.get("error", "no pid in the reply")))
    pid: int = reply["pid"]
    return pid


KSM_RUN = "/sys/kernel/mm/ksm/run"


def _check_ksmd() -> None:
    """``--ksm`` marks pages mergeable; only ksmd merges them, and only the operator starts it
    (a host-wide choice: docs/operations.md). Said once per agent start, never refused."""
    try:
        with open(KSM_RUN) as f:
            run = f.read().strip()
    except OSError:
        log.warning("--ksm has no effect: this kernel has no same-page merging (%s)", KSM_RUN)
        return
    if run != "1":
        log.warning("--ksm has no effect until ksmd runs: echo 1 > %s (it is %s)", KSM_RUN, run)


def _call(path: str, req: dict[str, Any], timeout: float) -> tuple[dict[str, Any], ProcId | None]:
    """One blocking request to the template (agent start-up only)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout)
        s.connect(path)
        ident = peer_ident_of(s)
        s.send(template_wire.encode(req))
        return template_wire.decode(s.recv(template_wire.MAX_MESSAGE)), ident


def peer_ident_of(conn: socket.socket) -> ProcId | None:
    """The identity of the process that bound the socket ``conn`` is connected to."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    except OSError:
        return None
    return ProcId.of(int.from_bytes(creds[0:4], sys.byteorder))


def _peer_ident(path: str) -> ProcId | None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.settimeout(0.5)
        try:
            s.connect(path)
        except OSError:
            return None
        return peer_ident_of(s)
