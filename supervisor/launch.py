"""Starting the step's tasks (I/O).

Each task is a direct child of the supervisor, leads its own process group, starts with stdin on
/dev/null and stdout/stderr on files opened here (no byte of output passes through the agent or
this process), with every signal at its default: the supervisor installs Python handlers only,
which exec resets, and ignores or blocks nothing.

CPU affinity is set on this (main) thread just before the fork and restored after: a child
inherits the affinity of the thread that forked it, so no ``preexec_fn`` runs in the child.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import socket
import stat
import subprocess
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NoReturn

from tether.shared import faults, outpattern
from tether.shared.procid import start_ticks
from tether.supervisor.step import Step, Task, bounded

log = logging.getLogger(__name__)

GPU_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


class LaunchFailed(Exception):
    pass


def task_env(spec: dict[str, Any], rank: int) -> dict[str, str]:
    env = dict(spec["env"])
    gpus = ",".join(str(g) for g in spec["gpus"])
    for var in GPU_VARS:
        if spec["gpus"]:
            env[var] = gpus
        else:
            env.pop(var, None)
    cpus = spec["cpus"]
    per = len(cpus) // spec["ntasks"] if cpus else 0
    env.update({
        "TETHER_JOB_ID": str(spec["job"]),
        "TETHER_ATTEMPT": str(spec["attempt"]),
        "TETHER_TASK_ID": str(rank),
        "TETHER_NTASKS": str(spec["ntasks"]),
        "TETHER_JOB_NAME": spec["name"],
        "TETHER_CPUS": ",".join(str(c) for c in cpus[rank * per:(rank + 1) * per]),
    })
    array = spec.get("array")
    if isinstance(array, dict):
        env["TETHER_ARRAY_JOB_ID"] = str(array.get("id"))
        env["TETHER_ARRAY_TASK_ID"] = str(array.get("index"))
    return env


#: O_NONBLOCK so that a FIFO at an output path fails at once (ENXIO: no reader) instead of
#: blocking; it is cleared again once the fd is known to be a file or device.
_OUTPUT_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW
                 | os.O_CLOEXEC | os.O_NONBLOCK)
#: fds per SCM_RIGHTS message (the kernel takes at most 253): a job with per-task files
#: (``%t``) has up to two per task, sent in several messages.
_BATCH = 200
#: How long the rest of a batch may take once the first message arrived.
OPENER_TIMEOUT = 5.0


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


class Opener:
    """A forked child that becomes the job's user, enters the working directory and opens the
    output files, then hands the fds back over SCM_RIGHTS and exits.

    Nothing of the user's is executed or imported: no interpreter starts, the child is this
    process forked (it imports nothing), and it changes directory only after dropping
    privileges. The fds are checked here before any task gets them. The supervisor's loop polls
    ``sock`` and calls ``result()`` once it is readable, so the loop never waits for the
    user's files (a hung file system, say).
    """

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
        n = len(self.paths)
        if want < 0 or len(fds) != want or want < 1 + n:
            for fd in fds:
                os.close(fd)
            raise LaunchFailed(bounded(text if want < 0 else "the output opener sent "
                                       f"{len(fds)} of {want} files"))
        wd, outs, rest = fds[0], fds[1:1 + n], fds[1 + n:]
        readers: list[int | None] = []
        for flag in flags[:2]:
            readers.append(rest.pop(0) if flag == "1" and rest else None)
        for fd in rest:
            os.close(fd)
        opened = Opened(wd, dict(zip(self.paths, outs, strict=True)), readers)
        try:
            _check_dir(wd, self.spec["workdir"])
            for path, fd in opened.outputs.items():
                _check_output(fd, path)
        except LaunchFailed:
            opened.close()
            for r in readers:
                if r is not None:
                    os.close(r)
            raise
        return opened


def _open_as_user(spec: dict[str, Any], paths: list[str], sock: socket.socket) -> NoReturn:
    """The opener child. Only os calls and formatting: no imports, no interpreter."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)  # the parent's wakeup fd is not ours to write
        if faults.supervisor_fault("opener-dies"):
            os._exit(code)
        if _runs_as_other_user(spec):
            os.setgroups(spec["groups"])
            os.setresgid(spec["gid"], spec["gid"], spec["gid"])
            os.setresuid(spec["uid"], spec["uid"], spec["uid"])
        os.umask(int(spec.get("umask", 0o022)))
        workdir = spec["workdir"]
        try:
            wd = os.open(workdir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            os.fchdir(wd)  # proves the user may enter it (search permission)
        except OSError as exc:
            raise _Refused(f"cannot enter working directory {workdir}: {exc.strerror}") \
                from None
        outs = []
        for path in paths:
            try:
                outs.append(os.open(path, _OUTPUT_FLAGS, 0o666))
            except OSError as exc:
                raise _Refused(f"cannot open output file {path}: {exc.strerror}") from None
        readers, flags = [], ""
        first = [outs[paths.index(outpattern.for_task(spec[name], 0))]
                 for name in ("output", "error")]
        for fd in first:  # rank 0's files: what introspection reads
            try:  # as the user: a file she may only write gives no reader
                readers.append(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC))
                flags += "1"
            except OSError:
                flags += "0"
        fds = [wd, *outs, *readers]
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


def _exec_reason(exc: OSError, spec: dict[str, Any], cwd: str) -> str:
    if exc.filename in (spec["workdir"], cwd):
        return f"cannot enter working directory {spec['workdir']}: {exc.strerror}"
    return f"cannot execute {spec['command'][0]!r}: {exc.strerror}"


def _runs_as_other_user(spec: dict[str, Any]) -> bool:
    return "uid" in spec and spec["uid"] != os.getuid()


def _skip_rest(step: Step, why: str) -> None:
    """Ranks never started count as done, so the step can end."""
    for task in step.tasks:
        if not task.pid and not task.done:
            task.done = True
            task.reason = bounded(f"not started: {why}")


#: Per-rank additions: (environment, fds to pass) before the fork, and a call after it.
Prepare = Callable[[int], tuple[dict[str, str], tuple[int, ...]]]
Spawned = Callable[[int], None]


class Launcher:
    """Holds the Popen objects so that subprocess never reaps them behind the reaper's back."""

    def __init__(self, prepare: Prepare | None = None, spawned: Spawned | None = None,
                 env_filter: Callable[[dict[str, str]], dict[str, str]] | None = None) -> None:
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        #: read-only fds on the output files, opened once at launch through /proc/self/fd:
        #: they stay on the very inodes the tasks write, whatever is later renamed or linked
        #: at the paths ("stdout", "stderr"; the same fd twice when both go to one file)
        self.readers: dict[str, int] = {}
        self.prepare = prepare
        self.spawned = spawned
        self.env_filter = env_filter
        #: entered around each fork: the step's cgroup (the child starts inside it, and so
        #: is inside before it execs; this process leaves again at once)
        self.contain: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext

    def launch(self, spec: dict[str, Any], step: Step, opened: Opened | LaunchFailed) -> None:
        """Start every task on what the opener handed back (or record why it could not).
        On a failure the started ones are killed by the caller. The opener's fds are closed
        here, whatever happens; the readers are kept."""
        if isinstance(opened, LaunchFailed):
            step.tasks[0].record_launch_failure(str(opened))
            step.note_exit(step.tasks[0])
            _skip_rest(step, str(opened))
            raise opened
        r_out, r_err = opened.readers[0], opened.readers[-1]
        # introspection follows the first task's files
        self.readers = {k: v for k, v in (("stdout", r_out), ("stderr", r_err))
                        if v is not None}
        if len(self.readers) < 2:
            log.warning("the job's user may not read its output files: inspect --output and "
                        "attach will say so")
        own_affinity = os.sched_getaffinity(0)
        try:
            for task in step.tasks:
                # each task's files (its own with %t, else everyone's the same)
                out = opened.outputs[outpattern.for_task(spec["output"], task.rank)]
                err = opened.outputs[outpattern.for_task(spec["error"], task.rank)]
                self._start(spec, task, out, err, opened.workdir)
                step.note_exit(task)
                if task.done:  # could not exec: the step fails, the others are not started
                    _skip_rest(step, task.reason or "launch failed")
                    raise LaunchFailed(task.reason or "launch failed")
        finally:
            os.sched_setaffinity(0, own_affinity)
            opened.close()

    def _start(self, spec: dict[str, Any], task: Task, out: int, err: int, wd: int) -> None:
        cpus = spec["affinity"][task.rank]
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError as exc:
                log.warning("task %d: cannot set CPU affinity %s: %s", task.rank, cpus, exc)
        env = task_env(spec, task.rank)
        if self.env_filter is not None:
            env = self.env_filter(env)
        pass_fds: tuple[int, ...] = ()
        if self.prepare is not None:
            extra, pass_fds = self.prepare(task.rank)
            env.update(extra)
        who: dict[str, Any] = {}
        if _runs_as_other_user(spec):
            who = {"user": spec["uid"], "group": spec["gid"], "extra_groups": spec["groups"]}
            env.update(HOME=spec["home"], USER=spec["user"], LOGNAME=spec["user"])
        # The directory the opener entered as the user, by its fd: a link swapped in at the
        # path since then changes nothing (the child's chdir runs before it drops to the user).
        cwd = f"/proc/self/fd/{wd}"
        try:
            with self.contain():
                proc = self._popen(spec, who, out, err, cwd, env, pass_fds)
        except OSError as exc:
            task.record_launch_failure(_exec_reason(exc, spec, cwd))
            log.warning("task %d: %s", task.rank, task.reason)
            try:  # where the user looks first; `show` has it too
                os.write(err, f"tether: task {task.rank}: {task.reason}\n".encode())
            except OSError:
                pass
            return
        finally:
            if self.spawned is not None:
                self.spawned(task.rank)
        self.procs[proc.pid] = proc
        task.pid = proc.pid
        task.start_ticks = start_ticks(proc.pid) or 0

    @staticmethod
    def _popen(spec: dict[str, Any], who: dict[str, Any], out: int, err: int, cwd: str,
               env: dict[str, str], pass_fds: tuple[int, ...]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
                spec["command"],
                **who,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=cwd,
                umask=int(spec.get("umask", 0o022)),
                env=env,
                process_group=0,
                close_fds=True,
                pass_fds=pass_fds,
                restore_signals=True,
            )

    def reaped(self, pid: int, status: int) -> None:
        proc = self.procs.pop(pid, None)
        if proc is not None:
            proc.returncode = os.waitstatus_to_exitcode(status)
