"""Starting supervisors detached from the agent, without ever blocking its loop (I/O).

The agent takes the run directory's lock *before* the spawn and hands the locked fd to the
supervisor: there is no moment in which a live supervisor's directory looks abandoned, so a
restarted agent can never take a starting supervisor for a dead one and run its job twice.

Two ways to start one, both ending in the same process: never the agent's child (cold: init's
or the nearest subreaper's; warm: the template's until it leaves), in a session of its own,
stdin on /dev/null, stdout and stderr appended to ``supervisors.log``; nothing sent to the
agent or its process group reaches it.
- **Warm** (``supervisor/template.py``): one request on the template's socket carries the lock,
  the log and the ready pipe as SCM_RIGHTS fds; the template forks the supervisor as its child
  (``os.fork``: the session is the supervisor's, which leads it; the kernel reaps it, and it
  goes to init or the nearest subreaper if the template leaves first) and replies with its
  pid. About 100 times cheaper than a Python start, and the child shares the template's
  memory pages.
- **Cold**, when the template is missing or broken (said once in the log): ``/bin/sh`` is
  started in a new session and backgrounds ``python -I -m tether.supervisor``, printing its pid.

This module holds the spawns in flight, their fds and timers; the template itself is
``template_client.py``, the shell ``spawn_cold.py``, the file system work ``spawn_prep.py``.

Neither waits: the run directory and its spec are made on a worker thread (``prep``), and the
template's reply, the shell's output and the ready pipe are fds the agent's
poller watches (``owns``/``readable``). The supervisor writes one byte to the ready pipe once
its socket is bound; only then does the agent connect, so its hello and claim arrive at once
instead of at some later reconnect retry of libzmq. EOF on the pipe without that byte means
the supervisor is gone before it was ready.

Races:
- The template takes the request but hangs: when it has answered nothing for
  ``TEMPLATE_TIMEOUT`` (a burst of requests queued behind each other is progress, not a hang),
  it is killed (it is broken), which also closes its copy of the lock. Lock still held: it did
  fork the supervisor, which goes on. Lock free: nothing started; the spawn is redone cold.
- The agent gives up on a request the template then serves: the template checks the connection
  before forking, and a supervisor still checks that the lock it holds is its run directory's
  current lock file before it binds anything (``supervisor/__main__.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

from tether.agent import spawn_cold, spawn_prep
from tether.agent.offload import Offload
from tether.agent.spawn_cold import SPAWN_TIMEOUT
from tether.agent.spawn_prep import SpawnError
from tether.agent.template_client import (
    TEMPLATE_LINGER,
    TEMPLATE_TIMEOUT,
    Template,
    peer_ident_of,
    read_pid,
)
from tether.shared import template_wire
from tether.shared.errors import Busy
from tether.shared.paths import Layout, RunDir
from tether.shared.template_wire import TemplateError
from tether.shared.timers import Timer, Timers

log = logging.getLogger("tether.agent")

#: How long a spawned supervisor may take to bind its socket before the agent connects anyway.
READY_TIMEOUT = 10.0

OnPid = Callable[[int], None]
OnReady = Callable[[], None]
OnGone = Callable[[str], None]
OnFailed = Callable[[BaseException], None]


class _Spawn:
    """One supervisor being started: its fds and what to tell the agent."""

    __slots__ = ("rd", "lock_fd", "ready_r", "conn", "proc", "out", "timers", "on_pid",
                 "on_ready", "on_gone", "env", "umask")

    def __init__(self, rd: RunDir, on_pid: OnPid, on_ready: OnReady, on_gone: OnGone,
                 env: dict[str, str], umask: int) -> None:
        self.rd = rd
        self.lock_fd = -1
        self.ready_r = -1
        self.conn: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.out = b""
        self.timers: list[Timer] = []
        self.on_pid = on_pid
        self.on_ready = on_ready
        self.on_gone = on_gone
        self.env = env
        self.umask = umask


class Spawner:
    """Every spawn in flight, and the agent's view of the supervisor template."""

    def __init__(self, layout: Layout, timers: Timers, watch: Callable[[int], None],
                 unwatch: Callable[[int], None], *, use_template: bool = True,
                 hold_prep: bool = False, ksm: bool = False,
                 template_linger: float = TEMPLATE_LINGER) -> None:
        self.layout = layout
        self.timers = timers
        self.watch = watch
        self.unwatch = unwatch
        self.by_fd: dict[int, _Spawn] = {}
        self.template = Template(layout, use=use_template, ksm=ksm, linger=template_linger)
        #: what a supervisor inherits of the agent's environment (read once: walking
        #: os.environ decodes every variable, ~0.2 ms a spawn)
        self.env = {k: v for k, v in os.environ.items()
                    if k.startswith(("PYTHON", "LANG", "LC_", "TETHER_"))}
        self.env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
        #: the file system work of each spawn, off the agent's loop (results come back here)
        self.prep = Offload(maxsize=1024)
        self.watch(self.prep.fileno())
        #: test-only fault ``hold-spawn-prep``: each preparation, its run directory made,
        #: creates ``prep.held`` in the state directory and waits for ``prep.go`` there
        self.hold_prep = hold_prep

    # ---- spawning --------------------------------------------------------------------------

    def spawn(self, rd: RunDir, spec: Callable[[], dict[str, Any]], *, on_pid: OnPid,
              on_ready: OnReady, on_gone: OnGone, on_failed: OnFailed,
              wanted: Callable[[], bool] = lambda: True) -> None:
        """Start a supervisor for ``rd``, returning at once.

        ``spec()`` gives its spec, on the worker thread (it may look things up); the run
        directory is made there too. Back on the loop, ``wanted()`` is asked first (False:
        the run directory is removed and nothing more happens). ``on_pid`` gets its pid,
        ``on_ready`` is called once its socket is bound (or when ``READY_TIMEOUT`` has passed:
        the agent then connects and asks), ``on_gone`` if it ended before it was ready,
        ``on_failed`` (with what ``spec`` or the file system raised) if nothing could be
        started. One of the last three, exactly once, always later.
        """
        umask = os.umask(0o022)
        os.umask(umask)
        sp = _Spawn(rd, on_pid, on_ready, on_gone, self.env, umask)
        layout = self.layout
        hold = self.hold_prep

        def prepare() -> None:  # on the worker thread
            spawn_prep.prepare(layout, rd, spec())
            if hold:
                spawn_prep.hold(layout.state_dir)

        def prepared(_: Any, exc: BaseException | None) -> None:  # on the loop
            if exc is None and not wanted():
                shutil.rmtree(rd.path, ignore_errors=True)
                return
            if exc is None:
                try:
                    self._start(sp)
                    return
                except (SpawnError, OSError) as err:
                    self._close(sp)
                    exc = err
            on_failed(exc)
        try:
            self.prep.submit(prepare, prepared, "spawns")
        except Busy:  # a thousand spawns in the queue: this one is prepared here instead
            failed: BaseException | None = None
            try:
                prepare()
            except Exception as exc:  # as the worker would hand it over
                failed = exc
            self.timers.at(time.monotonic(), lambda: prepared(None, failed))

    def _start(self, sp: _Spawn) -> None:
        """Lock, ready pipe, then the template or else the shell."""
        sp.lock_fd = spawn_prep.lock(sp.rd)
        sp.ready_r, ready_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            conn = self.template.connect()
            if conn is not None and self._send(sp, conn, ready_w):
                return
            self._cold(sp, ready_w)
        finally:
            os.close(ready_w)

    def _send(self, sp: _Spawn, conn: socket.socket, ready_w: int) -> bool:
        log_fd = spawn_prep.open_log(self.layout)
        try:
            socket.send_fds(conn, [template_wire.spawn_request(sp.rd.path, sp.env, sp.umask)],
                            [sp.lock_fd, log_fd, ready_w])
        except (OSError, TemplateError) as exc:
            conn.close()
            self.template.failed(f"sending to it failed: {exc}")
            return False
        finally:
            os.close(log_fd)
        sp.conn = conn
        self._arm(sp, conn.fileno(), TEMPLATE_TIMEOUT, lambda: self._template_hung(sp))
        self._arm(sp, sp.ready_r, READY_TIMEOUT, lambda: self._settle(sp, ready=True))
        return True

    def _cold(self, sp: _Spawn, ready_w: int) -> None:
        sp.proc = spawn_cold.start_supervisor(self.layout, sp.rd, sp.lock_fd, ready_w, sp.env)
        # the shell and the supervisor have their own copies of the lock now
        os.close(sp.lock_fd)
        sp.lock_fd = -1
        assert sp.proc.stdout is not None
        self._arm(sp, sp.proc.stdout.fileno(), SPAWN_TIMEOUT, lambda: self._shell_hung(sp))
        self._arm(sp, sp.ready_r, READY_TIMEOUT, lambda: self._settle(sp, ready=True))

    def _arm(self, sp: _Spawn, fd: int, timeout: float, expire: Callable[[], None]) -> None:
        self.by_fd[fd] = sp
        self.watch(fd)
        sp.timers.append(self.timers.at(time.monotonic() + timeout, expire))

    # ---- events ----------------------------------------------------------------------------

    def owns(self, fd: int) -> bool:
        return fd in self.by_fd or fd == self.prep.fileno()

    def readable(self, fd: int) -> None:
        if fd == self.prep.fileno():
            self.prep.service()
            return
        sp = self.by_fd.get(fd)
        if sp is None:
            return
        if sp.conn is not None and fd == sp.conn.fileno():
            self._template_reply(sp)
        elif sp.proc is not None and sp.proc.stdout is not None and \
                fd == sp.proc.stdout.fileno():
            self._shell_output(sp)
        elif fd == sp.ready_r:
            try:
                data = os.read(fd, 16)
            except BlockingIOError:
                return
            self._settle(sp, ready=bool(data))

    def _template_reply(self, sp: _Spawn) -> None:
        assert sp.conn is not None
        try:
            data = sp.conn.recv(template_wire.MAX_MESSAGE)
        except BlockingIOError:
            return
        except OSError:
            data = b""  # reset by a dying template: decoded below as "closed"
        self._drop_conn(sp)
        self.template.answered = time.monotonic()
        try:
            pid = read_pid(data)
        except TemplateError as exc:
            self._template_broke(sp, str(exc))
            return
        self._release_lock(sp)
        sp.on_pid(pid)

    def _template_hung(self, sp: _Spawn) -> None:
        if sp.conn is None:
            return
        quiet = time.monotonic() - self.template.answered
        if quiet < TEMPLATE_TIMEOUT:  # busy with the requests queued before this one
            assert sp.conn is not None
            sp.timers.append(self.timers.at(time.monotonic() + TEMPLATE_TIMEOUT - quiet,
                                            lambda: self._template_hung(sp)))
            return
        ident = peer_ident_of(sp.conn)
        self._drop_conn(sp)
        self.template.kill(ident)
        self.template.started = -1e9  # start a new one at the next spawn
        self._template_broke(sp, f"no answer within {TEMPLATE_TIMEOUT:g}s; killed it")

    def _template_broke(self, sp: _Spawn, why: str) -> None:
        """The template failed this request: did it fork the supervisor anyway?"""
        self._release_lock(sp)
        self.template.failed(why)
        try:
            sp.lock_fd = spawn_prep.lock(sp.rd)
        except BlockingIOError:
            return  # a supervisor holds the lock: it started; the ready pipe tells the rest
        except OSError as exc:
            self._settle(sp, ready=False, why=f"cannot lock {sp.rd.lock} again: {exc}")
            return
        # Nothing started: do it cold, with a fresh ready pipe.
        self._unwatch(sp.ready_r)
        os.close(sp.ready_r)
        sp.ready_r = -1
        for t in sp.timers:
            t.cancel()
        sp.timers.clear()
        log.info("%s: starting its supervisor cold", sp.rd.path)
        sp.ready_r, ready_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            self._cold(sp, ready_w)
        except SpawnError as exc:
            self._settle(sp, ready=False, why=str(exc))
        finally:
            os.close(ready_w)

    def _shell_output(self, sp: _Spawn) -> None:
        assert sp.proc is not None and sp.proc.stdout is not None
        try:
            chunk = os.read(sp.proc.stdout.fileno(), 64)
        except BlockingIOError:
            return
        if chunk:
            sp.out += chunk
            return
        self._unwatch(sp.proc.stdout.fileno())
        sp.proc.stdout.close()
        spawn_cold.reap(sp.proc)
        sp.proc = None
        if sp.ready_r < 0:
            self._close(sp)
        try:
            pid = int(sp.out.strip())
        except ValueError:
            log.error("%s: the shell starting its supervisor printed no pid", sp.rd.path)
            return  # the ready pipe says whether anything started
        sp.on_pid(pid)

    def _shell_hung(self, sp: _Spawn) -> None:
        if sp.proc is None:
            return
        log.error("%s: the shell starting its supervisor did not finish within %gs; killed",
                  sp.rd.path, SPAWN_TIMEOUT)
        if sp.proc.stdout is not None:
            self._unwatch(sp.proc.stdout.fileno())
            sp.proc.stdout.close()
        sp.proc.kill()
        sp.proc.wait()
        sp.proc = None

    def _settle(self, sp: _Spawn, *, ready: bool, why: str | None = None) -> None:
        """The ready pipe spoke (or timed out): tell the agent, once."""
        if sp.ready_r < 0:
            return
        self._unwatch(sp.ready_r)
        os.close(sp.ready_r)
        sp.ready_r = -1
        if ready:
            sp.on_ready()
        else:
            sp.on_gone(why or "its supervisor exited before it was ready")
        if sp.conn is None and sp.proc is None:
            self._close(sp)

    # ---- cleanup ---------------------------------------------------------------------------

    def _drop_conn(self, sp: _Spawn) -> None:
        if sp.conn is not None:
            self._unwatch(sp.conn.fileno())
            sp.conn.close()
            sp.conn = None
        if sp.ready_r < 0 and sp.proc is None:
            self._close(sp)

    def _release_lock(self, sp: _Spawn) -> None:
        if sp.lock_fd >= 0:
            os.close(sp.lock_fd)
            sp.lock_fd = -1

    def _unwatch(self, fd: int) -> None:
        if self.by_fd.pop(fd, None) is not None:
            self.unwatch(fd)

    def _close(self, sp: _Spawn) -> None:
        for t in sp.timers:
            t.cancel()
        sp.timers.clear()
        if sp.conn is not None:
            self._unwatch(sp.conn.fileno())
            sp.conn.close()
            sp.conn = None
        if sp.proc is not None:
            if sp.proc.stdout is not None:
                self._unwatch(sp.proc.stdout.fileno())
                sp.proc.stdout.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                sp.proc.wait(timeout=1.0)
            sp.proc = None
        if sp.ready_r >= 0:
            self._unwatch(sp.ready_r)
            os.close(sp.ready_r)
            sp.ready_r = -1
        self._release_lock(sp)

    def close(self) -> None:
        """The agent stops: drop every fd. Supervisors started or starting carry on (a spawn
        still being prepared never starts: its job is 'starting' with no live supervisor,
        which the next agent's reattach resolves as for a crash)."""
        for sp in {id(s): s for s in self.by_fd.values()}.values():
            self._close(sp)
        self.by_fd.clear()
        self.unwatch(self.prep.fileno())
        self.prep.close()
