"""Starting the step's tasks (I/O).

Each task is a direct child of the supervisor, leads its own process group, starts with stdin on
/dev/null and stdout/stderr on files opened here (no byte of output passes through the agent or
this process), with every signal at its default: the supervisor installs Python handlers only,
which exec resets, and ignores or blocks nothing.

CPU affinity is set on this (main) thread just before the fork and restored after: a child
inherits the affinity of the thread that forked it, so no ``preexec_fn`` runs in the child.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from tether.shared import outpattern
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
    return env


#: O_NONBLOCK so that a FIFO at an output path fails at once (ENXIO: no reader) instead of
#: blocking the supervisor; it is cleared again once the fd is known to be a file or device.
_OUTPUT_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW
                 | os.O_CLOEXEC | os.O_NONBLOCK)

#: Run as the job's user (python -S -c): opens each output path with that user's rights and
#: O_NOFOLLOW, and hands the fds back over SCM_RIGHTS on the socket whose number is argv[1].
#: A string here, so nothing is imported from the (possibly upgraded) package at launch.
_OPENER = r"""
import os, socket, sys
s = socket.socket(fileno=int(sys.argv[1]))
fds = []
for path in sys.argv[2:]:
    try:
        fds.append(os.open(path, int(os.environ["TETHER_FLAGS"]), 0o644))
    except OSError as e:
        s.sendall(("cannot open output file %s: %s" % (path, e.strerror)).encode())
        sys.exit(1)
socket.send_fds(s, [b"ok"], fds)
"""


#: The interpreter behind our venv (which may lie where the job's user cannot go): the opener
#: needs only the standard library (-S), and the user must be able to execute it.
_BASE_PYTHON = os.path.realpath(sys.executable)


def _check_opened(fd: int, path: str) -> int:
    """Only a regular file or a character device (/dev/null) may take a job's output."""
    st = os.fstat(fd)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        os.close(fd)
        raise LaunchFailed(f"output file {path} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def _open_output(path: str) -> int:
    try:
        return _check_opened(os.open(path, _OUTPUT_FLAGS, 0o644), path)
    except OSError as exc:
        raise LaunchFailed(f"cannot open output file {path}: {exc.strerror}") from None


def _open_outputs_as(spec: dict[str, Any], paths: list[str]) -> list[int]:
    """Open ``paths`` as the job's user, in a short-lived child with that user's credentials."""
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen(
            [_BASE_PYTHON, "-S", "-c", _OPENER, str(theirs.fileno()), *paths],
            user=spec["uid"], group=spec["gid"], extra_groups=spec["groups"],
            pass_fds=(theirs.fileno(),), cwd=spec["workdir"], stdin=subprocess.DEVNULL,
            env={"TETHER_FLAGS": str(_OUTPUT_FLAGS)},
        )
        theirs.close()
        ours.settimeout(10)
        msg, fds, _, _ = socket.recv_fds(ours, 1024, len(paths))
        proc.wait(timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        raise LaunchFailed(f"cannot open the output files as {spec['user']}: {exc}") from None
    finally:
        theirs.close()
        ours.close()
    if msg != b"ok" or len(fds) != len(paths):
        for fd in fds:
            os.close(fd)
        raise LaunchFailed(msg.decode(errors="replace") or "cannot open the output files")
    for fd in fds:
        os.set_inheritable(fd, False)
    return [_check_opened(fd, path) for fd, path in zip(fds, paths, strict=True)]


def _open_task_outputs(spec: dict[str, Any], rank: int) -> tuple[list[int], int, int]:
    """The fds a task writes to (opened as the job's user when it is another one): the fds to
    close afterwards, its stdout and its stderr."""
    out_path = outpattern.for_task(spec["output"], rank)
    err_path = outpattern.for_task(spec["error"], rank)
    paths = [out_path] if err_path == out_path else [out_path, err_path]
    fds: list[int] = []
    try:
        if _runs_as_other_user(spec):
            fds = _open_outputs_as(spec, paths)
        else:
            for path in paths:
                fds.append(_open_output(path))
    except LaunchFailed:
        _close(fds)
        raise
    return fds, fds[0], fds[-1]


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _exec_reason(exc: OSError, spec: dict[str, Any]) -> str:
    if exc.filename == spec["workdir"]:
        return f"cannot enter working directory {spec['workdir']}: {exc.strerror}"
    return f"cannot execute {spec['command'][0]!r}: {exc.strerror}"


def _runs_as_other_user(spec: dict[str, Any]) -> bool:
    return "uid" in spec and spec["uid"] != os.getuid()


def _readers(out: int, err: int) -> dict[str, int]:
    readers: dict[str, int] = {}
    try:
        readers["stdout"] = os.open(f"/proc/self/fd/{out}", os.O_RDONLY | os.O_CLOEXEC)
        readers["stderr"] = (readers["stdout"] if err == out else
                             os.open(f"/proc/self/fd/{err}", os.O_RDONLY | os.O_CLOEXEC))
    except OSError as exc:  # output stays on disk; only introspection of it is lost
        log.warning("cannot open the output files for reading: %s", exc)
    return readers


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

    def launch(self, spec: dict[str, Any], step: Step) -> None:
        """Start every task. On a failure the started ones are killed by the caller."""
        # A name with %t gives each task its own files (the agent expanded every other token).
        per_task = outpattern.per_task(spec["output"]) or outpattern.per_task(spec["error"])
        fds: list[int] = []
        try:
            fds, out, err = _open_task_outputs(spec, 0)
        except LaunchFailed as exc:
            step.tasks[0].record_launch_failure(str(exc))
            step.note_exit(step.tasks[0])
            _skip_rest(step, str(exc))
            raise
        self.readers = _readers(out, err)  # introspection follows the first task's files
        own_affinity = os.sched_getaffinity(0)
        try:
            for task in step.tasks:
                if per_task and task.rank > 0:
                    _close(fds)
                    fds = []
                    try:
                        fds, out, err = _open_task_outputs(spec, task.rank)
                    except LaunchFailed as exc:
                        task.record_launch_failure(str(exc))
                if not task.done:
                    self._start(spec, task, out, err)
                step.note_exit(task)
                if task.done:  # could not exec: the step fails, the others are not started
                    _skip_rest(step, task.reason or "launch failed")
                    raise LaunchFailed(task.reason or "launch failed")
        finally:
            os.sched_setaffinity(0, own_affinity)
            _close(fds)

    def _start(self, spec: dict[str, Any], task: Task, out: int, err: int) -> None:
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
        try:
            proc = subprocess.Popen(
                spec["command"],
                **who,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=spec["workdir"],
                env=env,
                process_group=0,
                close_fds=True,
                pass_fds=pass_fds,
                restore_signals=True,
            )
        except OSError as exc:
            task.record_launch_failure(_exec_reason(exc, spec))
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

    def reaped(self, pid: int, status: int) -> None:
        proc = self.procs.pop(pid, None)
        if proc is not None:
            proc.returncode = os.waitstatus_to_exitcode(status)
