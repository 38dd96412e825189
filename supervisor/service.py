"""The supervisor's one event loop (I/O).

Theory of operation. One thread polls: the agent's ROUTER in ctl/ (ctl.py) and everyone's door
at ``sock``, the read end of a socketpair that signal handlers wake (``signal.set_wakeup_fd``:
the handlers themselves do nothing), the PMI ranks' sockets, and a heap of timers. Nothing
blocks anywhere else, and no other thread exists but libzmq's two (I/O and reaper, which run
no Python) and the short-lived ones a launch or a /proc scan starts.

Races this loop is built around:
- A task's exit and a request about it arrive in the same wake-up: signals are handled first, so
  a reply never reports a task alive that has already been reaped.
- SIGCHLD coalesces: every wake-up drains ``waitid`` until nothing is left.
- A task leader that exits leaves its process group behind: the group is SIGKILLed while the
  leader is still an unreaped zombie (``WNOWAIT``), so the group id cannot have been reused.
- Daemons that left the group (setsid) are re-parented to us, a child subreaper: once the last
  task is gone, every remaining child is killed by pid, which is safe because an unreaped child's
  pid cannot be reused.
- The exit record is durable (fsync, rename) before anyone is told the step ended.

The loop is this module; what it drives lives in parts named for what they do, mixins of
``Supervisor`` sharing one state (state.py): requests.py (both transports, one dispatch),
claims.py (claim to launch, or abort), terminating.py (SIGTERM, SIGKILL, the time limit),
reaping.py (reaping, draining, the end of the step), pmi_loop.py (the PMI server on the loop),
recording.py (manifest, exit record, events), follow.py (long polls, the ack linger) and
reexec.py (``upgrade``: re-executing into the installed release).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import stat
import time

import tether
from tether.shared import faults
from tether.shared.door_listener import listen_socket
from tether.supervisor import handover
from tether.supervisor.claims import Claims
from tether.supervisor.effects import Effects
from tether.supervisor.fencing import Fencing
from tether.supervisor.follow import Followers
from tether.supervisor.machine_events import TerminateRequested
from tether.supervisor.pmi_loop import PmiLoop
from tether.supervisor.reaping import Reaping
from tether.supervisor.recording import Recording
from tether.supervisor.reexec import Reexec
from tether.supervisor.requests import Requests
from tether.supervisor.state import IGNORED_SIGNALS, TERMINATING, killpg
from tether.supervisor.step import Phase, signal_name
from tether.supervisor.sweeper import hold
from tether.supervisor.terminating import Terminating

log = logging.getLogger("tether.supervisor")

#: How long after binding its socket an unclaimed supervisor writes the ``ready`` manifest.
READY_MANIFEST_AFTER = 0.1


class Supervisor(Effects, Requests, Claims, Terminating, Reaping, PmiLoop, Recording, Followers,
                 Reexec, Fencing):
    """One step's supervisor: the loop here, the rest in its parts (see the module docstring)."""

    def run(self) -> int:
        if self.start_kind != "warm":  # (a warm one has the template's, reset at its start)
            reset_signal_dispositions(unblock=False)
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        # Python-level handlers only (exec resets them, so tasks start with defaults). Stray
        # SIGQUIT/SIGUSR1/SIGUSR2 must not kill the step's supervisor: they are logged.
        for sig in (signal.SIGCHLD, *TERMINATING, *IGNORED_SIGNALS):
            signal.signal(sig, _wake_only)
        # only now: a re-executed supervisor arrives with these blocked (handover.py)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        # The agent's ROUTER inside ctl/ (0700): no other user can even connect to it. People
        # come through the door at ``sock``. Every request, on either, is authorized per verb
        # by the kernel's credentials of its connection. Both listening sockets are kept
        # across an upgrade's exec (handover.py).
        if self.listen_fd < 0:
            private_dir(self.rd.ctl)
            old_umask = os.umask(0o077)
            try:
                self.listen_fd = handover.listen(self.rd.ctl_sock)
            finally:
                os.umask(old_umask)
            self.door_fd = listen_socket(self.rd.sock)
        # Both sockets listen: the agent may connect now. Its connection waits in the kernel's
        # backlog while ZeroMQ starts (the context, the ROUTER on that socket) and the door is
        # set up, which the agent's own work to connect and say hello overlaps.
        self.signal_ready()
        if faults.supervisor_fault("hold-after-ready"):
            hold(self.rd.path, "ready")
        self.open_doors()
        if self.resumed:
            self.write_manifest()
            log.info("re-executed as tether %s (was %s), generation %d; serving %s again",
                     tether.__version__, self.upgraded_from, self.generation, self.rd.sock)
            if self.step.phase in (Phase.RUNNING, Phase.DRAINING):
                self.reap()  # a task may have ended while signals were blocked
        else:
            # A "ready" manifest says what no manifest says (never ran: every reader takes the
            # two alike), so it is written only if the claim is late: a launch answers the
            # agent's hello at once and writes one file less (recording.py)
            self.arm("ready", time.monotonic() + READY_MANIFEST_AFTER)
            self.arm("claim", time.monotonic() + float(self.spec["claim_timeout"]))
            log.info("ready on %s (%s start); waiting up to %gs for the agent's claim",
                     self.rd.sock, self.start_kind, self.spec["claim_timeout"])
        poller = self.poller
        poller.register(wake_r, select.POLLIN)
        poller.register(self.sweeper.fileno(), select.POLLIN)
        poller.register(self.scans.fileno(), select.POLLIN)
        status = 0
        try:
            while self.running:
                events = dict(poller.poll(self.timers.timeout_ms(time.monotonic())))
                try:
                    if wake_r.fileno() in events:
                        self.on_signals(wake_r)
                    if self.ctl is not None and self.ctl.fileno() in events:
                        self.ctl.service()
                    if self.door is not None and self.door.fileno() in events:
                        self.door.service()
                    if self.opener is not None and self.opener.fileno() in events:
                        self.opener_ready()
                    if self.sweeper.fileno() in events:
                        self.swept()
                    if self.scans.fileno() in events:
                        self.scanned()
                    if self.upgrade_requested:
                        self.upgrade_requested = False
                        self.reexec()  # returns only if exec failed
                    if self.channels is not None:
                        self.pmi_events(events)
                    self.timers.run_due(time.monotonic())
                    self.settle_ctl()  # the agent's requests a send's wake-up may have hidden
                except Exception:
                    # Crash-only: requests and launches handle their own errors; anything else
                    # means this process cannot be trusted to go on. Its tasks are killed, so
                    # none runs untracked, and the agent gives the verdict from the run
                    # directory (lost: the manifest says the tasks ran).
                    log.exception("the supervisor cannot go on; killing the step's tasks and "
                                  "exiting")
                    self.give_up()
                    status = 3
                    break
        finally:
            self.close_doors(unlink=True)  # the last reply (to ``ack``) is delivered first
            os.close(self.listen_fd)
            if self.door_fd >= 0:
                os.close(self.door_fd)
            if self.channels is not None:
                self.channels.close_all()
            self.sweeper.close()
            self.scans.close()
            if self.remove_rundir:
                remove_tree(self.rd.path)
        log.info("supervisor exits")
        return status

    def give_up(self) -> None:
        for task in self.step.tasks:
            if task.pid and not task.done:
                killpg(task.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.kill_cgroup()
        with contextlib.suppress(Exception):
            self.sweep_now()

    def signal_ready(self) -> None:
        if self.ready_fd < 0:
            return
        try:
            os.write(self.ready_fd, b"r")
        except OSError as exc:  # the agent went away: a restarted one finds us by the lock
            log.info("ready pipe: %s", exc)
        os.close(self.ready_fd)
        self.ready_fd = -1

    def on_signals(self, wake_r: socket.socket) -> None:
        got: set[int] = set()
        while True:
            try:
                data = wake_r.recv(4096)
            except BlockingIOError:
                break
            if not data:
                break
            got.update(data)
        if signal.SIGCHLD in got or self.step.phase in (Phase.RUNNING, Phase.DRAINING):
            self.reap()
        for sig in got & set(IGNORED_SIGNALS):
            # (the fault first: a supervisor that says "ignored" and then dies misleads
            # whoever reads the log, tests/integration/test_template.py among them)
            if sig == signal.SIGUSR2 and faults.supervisor_fault("error-on-usr2"):
                raise RuntimeError("test fault: an error nothing in the loop expects")
            log.warning("received %s: ignored", signal_name(sig))
        for sig in got & set(TERMINATING):
            log.warning("received %s: terminating the step", signal_name(sig))
            self.feed(TerminateRequested(grace=float(self.spec.get("kill_grace", 10)), cancel=False,
                                         why=f"supervisor received {signal_name(sig)}"))


def private_dir(path: str) -> None:
    """``path`` as a directory only this uid may enter: made if missing, refused if it is a
    link, someone else's, or open to others (its socket would be reachable)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{path} is not a private directory of uid {os.getuid()} "
                      f"(mode {stat.filemode(st.st_mode)}, owner {st.st_uid})")


def reset_signal_dispositions(*, unblock: bool = True) -> None:
    """Undo what the detaching shell left: a background job starts with SIGINT and SIGQUIT
    ignored, and ignored signals survive exec, so tasks would inherit them. Python's own
    SIGPIPE/SIGXFSZ ignores are reset for children by Popen's restore_signals."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ):
            continue
        try:
            if signal.getsignal(sig) == signal.SIG_IGN:
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    if unblock:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _wake_only(signum: int, frame: object) -> None:
    """The real work happens in the loop, woken through the wakeup fd."""


def remove_tree(path: str) -> None:
    """Remove the run directory and everything in it (files, sockets, ``ctl/``), following no
    symlink, errors ignored (what stays, the agent removes once the lock is free). Not
    ``shutil.rmtree``: shutil imports bz2 and lzma, whose libraries every fork would copy."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # scandir's own fd (EMFILE), as in _empty's subdirs
            _empty(fd, 0)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _empty(dir_fd: int, depth: int) -> None:
    with os.scandir(dir_fd) as entries:
        names = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
    for name, is_dir in names:
        with contextlib.suppress(OSError):
            if not is_dir:
                os.unlink(name, dir_fd=dir_fd)
                continue
            if depth >= 8:  # a run directory is two levels deep: nothing of ours is deeper
                continue
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=dir_fd)
            try:
                _empty(sub, depth + 1)
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=dir_fd)
