"""The job's working directory and output files, opened with the job's user's credentials before
any task starts (I/O).

What is opened, and how, is one function (``_open_files``): the umask the user submitted with,
the working directory entered (which proves the user may search it), every output path opened
relative to it with ``O_NOFOLLOW`` and ``O_NONBLOCK`` (a link or a FIFO planted at the path fails
at once), and read-only fds on rank 0's files reopened through ``/proc/self/fd`` (none where the
user may only write). The fds are checked here, on the loop, before any task gets them
(``_checked``), and the reasons a launch fails are the same words whichever way they were opened.

Two ways to run it, neither on the loop (a hung file system must not stop the supervisor from
answering; the loop polls ``fileno()`` and calls ``result()`` once it is readable):

- ``Opener``, for a job of another user: a forked child becomes the user (groups, gid, uid) and
  only then enters the directory and opens, and hands the fds back over SCM_RIGHTS. Nothing of
  the user's is executed or imported: no interpreter starts, the child is this process forked
  (it imports nothing).
- ``ThreadOpener``, when the job's user is the supervisor's own (nothing to become): a thread of
  this process that first takes a private copy of the process's working directory and umask
  (``unshare(CLONE_FS)``), so that its ``fchdir`` and ``umask`` are exactly the child's and
  touch no other thread, then makes the same calls. It spares the fork of the whole supervisor
  (page tables, copy-on-write faults, its exit and reaping). Where the kernel refuses
  ``unshare`` (a container's seccomp policy) ``result`` raises ``ForkInstead`` and the caller
  starts an ``Opener``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import signal
import socket
import stat
import threading
from _thread import start_new_thread
from dataclasses import dataclass
from typing import Any, NoReturn

from tether.shared import faults, outpattern
from tether.shared.wakeup import Wakeup
from tether.supervisor.step import bounded


class LaunchFailed(Exception):
    pass


class ForkInstead(Exception):
    """The thread could not have a working directory and umask of its own: fork an opener."""


#: O_NONBLOCK so that a FIFO at an output path fails at once (ENXIO: no reader) instead of
#: blocking; it is cleared again once the fd is known to be a file or device.
_OUTPUT_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW
                 | os.O_CLOEXEC | os.O_NONBLOCK)
#: fds per SCM_RIGHTS message (the kernel takes at most 253): a job with per-task files
#: (``%t``) has up to two per task, sent in several messages.
_BATCH = 200
#: How long the rest of a batch may take once the first message arrived.
OPENER_TIMEOUT = 5.0
#: unshare(2): the calling thread's own copy of root, working directory and umask
CLONE_FS = 0x200
#: test-only fault: the thread's unshare fails (EPERM) as under a seccomp policy
REFUSE_UNSHARE = "refuse-unshare"

_libc = ctypes.CDLL(None, use_errno=True)


def output_paths(spec: dict[str, Any]) -> list[str]:
    """Every distinct file the tasks write, in order: rank 0's output (and error), then the
    other ranks' when the names have ``%t`` (the agent expanded every other token)."""
    per_task = outpattern.per_task(spec["output"]) or outpattern.per_task(spec["error"])
    paths: list[str] = []
    for rank in range(spec["ntasks"] if per_task else 1):
        for name in (spec["output"], spec["error"]):
            path = outpattern.for_task(name, rank)
            if path not in paths:
                paths.append(path)
    return paths


def runs_as_other_user(spec: dict[str, Any]) -> bool:
    return "uid" in spec and spec["uid"] != os.getuid()


@dataclass
class Opened:
    """What the opener handed back, all opened with the job's user's credentials."""

    workdir: int  #: O_PATH fd of the working directory (tasks start there via /proc/self/fd)
    outputs: dict[str, int]  #: path -> write fd, one per distinct output path
    readers: list[int | None]  #: read-only fds on rank 0's files (None: the user may not read)

    def close(self) -> None:
        for fd in [self.workdir, *self.outputs.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)


def new_opener(spec: dict[str, Any], paths: list[str], *,
               fork: bool = False) -> Opener | ThreadOpener:
    """The opener for this job: forked for another user (or when asked), else a thread."""
    if fork or runs_as_other_user(spec):
        return Opener(spec, paths)
    return ThreadOpener(spec, paths)


class Opener:
    """A forked child that becomes the job's user, enters the working directory and opens the
    output files, then hands the fds back over SCM_RIGHTS and exits."""

    def __init__(self, spec: dict[str, Any], paths: list[str]) -> None:
        self.spec = spec
        self.paths = paths
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            ours.close()
            _open_as_user(spec, paths, theirs)
        theirs.close()
        ours.setblocking(False)
        self.sock = ours

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def result(self) -> Opened:
        """The checked fds, or LaunchFailed with the reason. The first message is in (the
        loop saw the socket readable); the rest of a large batch follows at once."""
        fds: list[int] = []
        try:
            msg, got, _, _ = socket.recv_fds(self.sock, 4096, _BATCH)
            fds += got
            if not msg and not got:  # EOF: killed, or out of memory, before it could say
                raise LaunchFailed(f"the output opener (pid {self.pid}) ended without an "
                                   "answer")
            text = msg.decode(errors="replace")
            head, _, flags = text.partition(";")
            want = int(head[3:]) if head.startswith("ok:") and head[3:].isdigit() else -1
            self.sock.settimeout(OPENER_TIMEOUT)
            while 0 <= len(fds) < want:
                _, got, _, _ = socket.recv_fds(self.sock, 16, _BATCH)
                if not got:
                    break
                fds += got
        except (OSError, ValueError) as exc:
            for fd in fds:
                os.close(fd)
            raise LaunchFailed(f"cannot open the output files as {self.spec.get('user')}: "
                               f"{exc}") from None
        if want < 0 or len(fds) != want or want < 1 + len(self.paths):
            for fd in fds:
                os.close(fd)
            raise LaunchFailed(bounded(text if want < 0 else "the output opener sent "
                                       f"{len(fds)} of {want} files"))
        return _checked(self.spec, self.paths, fds, flags)


class ThreadOpener:
    """The same opens on a thread with a working directory and umask of its own, for a job
    whose user is the supervisor's own. The fds never leave this process."""

    def __init__(self, spec: dict[str, Any], paths: list[str]) -> None:
        self.spec = spec
        self.paths = paths
        self.wakeup = Wakeup()
        self._lock = threading.Lock()
        #: the loop gave up on it (``kill``): whatever it opens after is closed, never handed
        self._abandoned = False
        #: (fds, reader flags), the reason it failed, or ForkInstead
        self._outcome: tuple[list[int], str] | str | ForkInstead | None = None
        # not threading.Thread: its start() waits for the thread to run (two context switches
        # on the launch's path); nothing here joins it
        start_new_thread(self._run, ())

    def fileno(self) -> int:
        return self.wakeup.fileno()

    def close(self) -> None:
        self.wakeup.close()

    def kill(self) -> None:
        """Give up on it: a thread cannot be killed, so what it opens is closed by it."""
        with self._lock:
            self._abandoned = True
            outcome, self._outcome = self._outcome, None
        if isinstance(outcome, tuple):
            _close_all(outcome[0])

    def result(self) -> Opened:
        self.wakeup.drain()
        with self._lock:
            outcome, self._outcome = self._outcome, None
        if isinstance(outcome, ForkInstead):
            raise outcome
        if not isinstance(outcome, tuple):
            raise LaunchFailed(bounded(outcome or "the output opener ended without an answer"))
        fds, flags = outcome
        return _checked(self.spec, self.paths, fds, flags)

    def _run(self) -> None:
        outcome: tuple[list[int], str] | str | ForkInstead
        try:
            if faults.supervisor_fault(REFUSE_UNSHARE):
                outcome = ForkInstead(f"unshare(CLONE_FS): {os.strerror(errno.EPERM)}")
            elif _libc.unshare(CLONE_FS) != 0:
                outcome = ForkInstead(f"unshare(CLONE_FS): {os.strerror(ctypes.get_errno())}")
            else:
                outcome = _open_files(self.spec, self.paths)
        except _Refused as exc:
            outcome = str(exc)[:4000]
        except BaseException as exc:  # noqa: BLE001  (the loop must hear of it, whatever it is)
            outcome = f"cannot open the output files: {exc}"[:4000]
        with self._lock:
            handed = not self._abandoned
            if handed:
                self._outcome = outcome
        if not handed and isinstance(outcome, tuple):  # given up on meanwhile
            _close_all(outcome[0])
        self.wakeup.kick()


def _open_files(spec: dict[str, Any], paths: list[str]) -> tuple[list[int], str]:
    """As the job's user (already): the umask, the working directory, the output files and
    rank 0's readers. Returns (fds, reader flags); raises _Refused with the reason, having
    closed what it opened. Only os calls and formatting: no imports, no interpreter."""
    os.umask(int(spec.get("umask", 0o022)))
    workdir = spec["workdir"]
    try:
        wd = os.open(workdir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise _Refused(f"cannot enter working directory {workdir}: {exc.strerror}") from None
    fds = [wd]
    try:
        try:
            os.fchdir(wd)  # proves the user may enter it (search permission)
        except OSError as exc:
            raise _Refused(f"cannot enter working directory {workdir}: {exc.strerror}") \
                from None
        for path in paths:
            try:
                fds.append(os.open(path, _OUTPUT_FLAGS, 0o666))
            except OSError as exc:
                raise _Refused(f"cannot open output file {path}: {exc.strerror}") from None
        outs = fds[1:]
        flags = ""
        for name in ("output", "error"):  # rank 0's files: what introspection reads
            fd = outs[paths.index(outpattern.for_task(spec[name], 0))]
            try:  # as the user: a file she may only write gives no reader
                fds.append(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC))
                flags += "1"
            except OSError:
                flags += "0"
    except BaseException:
        _close_all(fds)
        raise
    return fds, flags


def _open_as_user(spec: dict[str, Any], paths: list[str], sock: socket.socket) -> NoReturn:
    """The forked opener child. Only os calls and formatting: no imports, no interpreter."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)  # the parent's wakeup fd is not ours to write
        if faults.supervisor_fault("opener-dies"):
            os._exit(code)
        if runs_as_other_user(spec):
            os.setgroups(spec["groups"])
            os.setresgid(spec["gid"], spec["gid"], spec["gid"])
            os.setresuid(spec["uid"], spec["uid"], spec["uid"])
        fds, flags = _open_files(spec, paths)
        socket.send_fds(sock, [f"ok:{len(fds)};{flags}".encode()], fds[:_BATCH])
        for i in range(_BATCH, len(fds), _BATCH):
            socket.send_fds(sock, [b"more"], fds[i:i + _BATCH])
        code = 0
    except _Refused as exc:
        with contextlib.suppress(OSError):
            sock.send(str(exc).encode(errors="replace")[:4000])
    except BaseException as exc:  # noqa: BLE001  (the child must reach _exit, whatever happens)
        with contextlib.suppress(BaseException):
            sock.send(f"cannot open the output files: {exc}".encode(errors="replace")[:4000])
    os._exit(code)


class _Refused(Exception):
    pass


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _checked(spec: dict[str, Any], paths: list[str], fds: list[int], flags: str) -> Opened:
    """Split what an opener handed back (the workdir, one fd per path, the readers flags say)
    and check every fd before any task gets it; LaunchFailed (all closed) if one is wrong."""
    n = len(paths)
    if len(fds) < 1 + n:
        _close_all(fds)
        raise LaunchFailed(f"the output opener sent {len(fds)} files, not {1 + n} or more")
    wd, outs, rest = fds[0], fds[1:1 + n], fds[1 + n:]
    readers: list[int | None] = []
    for flag in flags[:2]:
        readers.append(rest.pop(0) if flag == "1" and rest else None)
    _close_all(rest)
    opened = Opened(wd, dict(zip(paths, outs, strict=True)), readers)
    try:
        _check_dir(wd, spec["workdir"])
        for path, fd in opened.outputs.items():
            _check_output(fd, path)
    except LaunchFailed:
        opened.close()
        _close_all([r for r in readers if r is not None])
        raise
    return opened


def _check_dir(fd: int, path: str) -> None:
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            raise LaunchFailed(f"working directory {path} is not a directory")
    except OSError as exc:
        raise LaunchFailed(f"cannot enter working directory {path}: {exc.strerror}") from None


def _check_output(fd: int, path: str) -> None:
    """Only a regular file or a character device (/dev/null), opened for writing, may take a
    job's output: anything else the opener sent (an O_PATH fd, a FIFO) fails the launch."""
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISCHR(st.st_mode)):
            raise LaunchFailed(f"output file {path} is not a regular file")
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if flags & os.O_PATH or flags & os.O_ACCMODE != os.O_WRONLY:
            raise LaunchFailed(f"output file {path} was not opened for writing")
        os.set_blocking(fd, True)
    except OSError as exc:
        raise LaunchFailed(f"cannot use output file {path}: {exc.strerror}") from None
