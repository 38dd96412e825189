"""Starting the step's tasks (I/O).

Each task is a direct child of the supervisor, leads its own process group, starts with stdin on
/dev/null and stdout/stderr on the files opened as the job's user before (opener.py; no byte of
output passes through the agent or this process), with every signal at its default: the
supervisor installs Python handlers only, which exec resets, and ignores or blocks nothing.

CPU affinity is set on this (main) thread just before the fork and restored after: a child
inherits the affinity of the thread that forked it, so no ``preexec_fn`` runs in the child.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from tether.shared import batch, outpattern
from tether.shared.procid import boot_ticks, start_ticks
from tether.supervisor.opener import LaunchFailed, Opened, runs_as_other_user
from tether.supervisor.step import Step, Task, bounded

log = logging.getLogger(__name__)

GPU_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def hwloc_env(xml: str) -> dict[str, str]:
    """What makes hwloc load the node's topology from ``xml`` (agent/topology.py): as this
    machine's, binding for real, with the CPUs and memory allowed read from the process's own
    cgroup rather than the file."""
    return {"HWLOC_XMLFILE": xml, "HWLOC_THISSYSTEM": "1",
            "HWLOC_THISSYSTEM_ALLOWED_RESOURCES": "1"}


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
    xml = spec.get("hwloc_xml")
    if xml and "HWLOC_XMLFILE" not in env:  # the job's own choice wins (agent/topology.py)
        env.update(hwloc_env(xml))
    array = spec.get("array")
    if isinstance(array, dict):
        env["TETHER_ARRAY_JOB_ID"] = str(array.get("id"))
        env["TETHER_ARRAY_TASK_ID"] = str(array.get("index"))
    if spec.get("slurm_env") is True:  # submit --export-slurm-env: asked for, never by default
        env.update(slurm_env(env, spec))
    return env


#: Slurm's names of the job variables (``submit --export-slurm-env``): each a copy of tether's
SLURM_NAMES: dict[str, tuple[str, ...]] = {
    "TETHER_JOB_ID": ("SLURM_JOB_ID", "SLURM_JOBID"),
    "TETHER_JOB_NAME": ("SLURM_JOB_NAME",),
    "TETHER_NTASKS": ("SLURM_NTASKS", "SLURM_NPROCS"),
    "TETHER_TASK_ID": ("SLURM_PROCID", "SLURM_LOCALID"),
    "TETHER_ARRAY_JOB_ID": ("SLURM_ARRAY_JOB_ID",),
    "TETHER_ARRAY_TASK_ID": ("SLURM_ARRAY_TASK_ID",),
    "TETHER_ARRAY_TASK_COUNT": ("SLURM_ARRAY_TASK_COUNT",),
    "TETHER_ARRAY_TASK_MIN": ("SLURM_ARRAY_TASK_MIN",),
    "TETHER_ARRAY_TASK_MAX": ("SLURM_ARRAY_TASK_MAX",),
    "TETHER_ARRAY_TASK_STEP": ("SLURM_ARRAY_TASK_STEP",),
    "TETHER_SUBMIT_DIR": ("SLURM_SUBMIT_DIR",),
}


def slurm_env(env: dict[str, str], spec: dict[str, Any]) -> dict[str, str]:
    """The Slurm-named copies of a task's job variables (``env``, tether's already set), and
    what Slurm says of the one node a tether job runs on."""
    out = {name: env[var] for var, names in SLURM_NAMES.items() if var in env for name in names}
    cpus = spec["cpus"]
    out.update(SLURM_NNODES="1", SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0",
               SLURM_CPUS_PER_TASK=str(len(cpus) // spec["ntasks"] if cpus else 1),
               SLURM_JOB_CPUS_PER_NODE=str(len(cpus)), SLURM_TASKS_PER_NODE=str(spec["ntasks"]))
    node = spec.get("node")
    if isinstance(node, str) and node:
        out.update(SLURM_JOB_NODELIST=node, SLURM_NODELIST=node, SLURMD_NODENAME=node)
    if spec.get("memory_mb"):
        out["SLURM_MEM_PER_NODE"] = str(spec["memory_mb"])
    return out


def _exec_reason(exc: OSError, spec: dict[str, Any], cwd: str, program: str) -> str:
    if exc.filename in (spec["workdir"], cwd):
        return f"cannot enter working directory {spec['workdir']}: {exc.strerror}"
    return f"cannot execute {program!r}: {exc.strerror}"


def script_fd(spec: dict[str, Any]) -> int | None:
    """A batch job's script (``spec["script"]``, the agent's copy in the run directory) in a
    sealed memfd for the tasks to read: no file of any user's is involved, and no task can
    change what the others read. None for a job whose command is a program."""
    path = spec.get("script")
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            data = b""
            while chunk := os.read(fd, 1 << 16):
                data += chunk
                if len(data) > batch.MAX_SCRIPT:
                    raise OSError(errno.EFBIG, "longer than a script may be")
        finally:
            os.close(fd)
        mfd = os.memfd_create(f"tether-script-{spec['job']}",
                              os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise LaunchFailed(f"cannot read the job's script: {exc.strerror or exc}") from None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(mfd, view):]
        fcntl.fcntl(mfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
    except OSError as exc:
        os.close(mfd)
        raise LaunchFailed(f"cannot hand the job's script over: {exc.strerror}") from None
    spec["script_argv"] = [*batch.interpreter(data), f"/proc/self/fd/{mfd}"]
    return mfd


def argv_of(spec: dict[str, Any]) -> list[str]:
    """What a task executes: the command, or for a batch job its script's interpreter, the
    script (on the fd ``script_fd`` made) and the script's arguments."""
    head = spec.get("script_argv")
    return spec["command"] if head is None else [*head, *spec["command"][1:]]


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
        #: called once the first task is started, before the next (the ``hold-after-task``
        #: test fault: a test looks at this process between two forks)
        self.after_first: Callable[[], None] | None = None
        #: a batch job's script while the tasks are started (``script_fd``)
        self.script: int | None = None

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
        try:
            try:
                self.script = script_fd(spec)
            except LaunchFailed as exc:
                step.tasks[0].record_launch_failure(str(exc))
                step.note_exit(step.tasks[0])
                _skip_rest(step, str(exc))
                raise
            for task in step.tasks:
                # each task's files (its own with %t, else everyone's the same)
                out = opened.outputs[outpattern.for_task(spec["output"], task.rank)]
                err = opened.outputs[outpattern.for_task(spec["error"], task.rank)]
                self._start(spec, task, out, err, opened.workdir)
                step.note_exit(task)
                if task.done:  # could not exec: the step fails, the others are not started
                    _skip_rest(step, task.reason or "launch failed")
                    raise LaunchFailed(task.reason or "launch failed")
                if task.rank == 0 and self.after_first is not None:
                    self.after_first()
        finally:
            opened.close()
            if self.script is not None:  # the tasks hold it now
                os.close(self.script)
                self.script = None

    def _start(self, spec: dict[str, Any], task: Task, out: int, err: int, wd: int) -> None:
        env = task_env(spec, task.rank)
        if self.env_filter is not None:
            env = self.env_filter(env)
        pass_fds: tuple[int, ...] = ()
        if self.prepare is not None:
            extra, pass_fds = self.prepare(task.rank)
            env.update(extra)
        if self.script is not None:
            pass_fds = (*pass_fds, self.script)
        argv = argv_of(spec)
        who: dict[str, Any] = {}
        if runs_as_other_user(spec):
            who = {"user": spec["uid"], "group": spec["gid"], "extra_groups": spec["groups"]}
            env.update(HOME=spec["home"], USER=spec["user"], LOGNAME=spec["user"])
        # The directory the opener entered as the user, by its fd: a link swapped in at the
        # path since then changes nothing (the child's chdir runs before it drops to the user).
        cwd = f"/proc/self/fd/{wd}"
        try:
            with self.contain(), _pinned(task.rank, spec["affinity"][task.rank]):
                before = boot_ticks()
                proc = self._popen(spec, argv, who, out, err, cwd, env, pass_fds)
                after = boot_ticks()
        except OSError as exc:
            task.record_launch_failure(_exec_reason(exc, spec, cwd, argv[0]))
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
        # the child's start ticks from the clock around its fork (procid.boot_ticks); /proc
        # only when a tick passed meanwhile (~5% of launches)
        task.start_ticks = before if before == after else (start_ticks(proc.pid) or 0)

    @staticmethod
    def _popen(spec: dict[str, Any], argv: list[str], who: dict[str, Any], out: int, err: int,
               cwd: str, env: dict[str, str], pass_fds: tuple[int, ...],
               ) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
                argv,
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


@contextlib.contextmanager
def _pinned(rank: int, cpus: list[int]) -> Iterator[None]:
    """This process on the task's CPUs while it forks the task (the child inherits them before
    it execs: no window in which the task runs elsewhere), and back on its own at once: the
    task starts on one of those CPUs, and a supervisor still pinned there may wait for the
    task's time slice before it can start the next rank (seen once under perf with MPICH; the
    MPI benchmark's A/B did not move, bench/README.md)."""
    if not cpus:
        yield
        return
    own = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        log.warning("task %d: cannot set CPU affinity %s: %s", rank, cpus, exc)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)

