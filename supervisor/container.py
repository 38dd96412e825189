"""Running a step's tasks in containers through an OCI runtime (crun, runc) (I/O).

Each task is the runtime's ``run`` in the foreground: the runtime is the supervisor's child
(task.pid, its own process group) and waits for the container's process, forwards the signals
it gets to it, and exits with its status (128+N for signal N, decoded back here). The runtime
runs as the user, rootless: it is never more privileged than she is, so every path of hers it
opens (the root filesystem, the mounts' sources) is opened with her rights alone, and what a
configuration could ask for is what her user namespace allows. Its cgroup handling is off:
the task is started inside the step's cgroup (Launcher.contain) and every process of the
container stays there (memory limit, freezer, kill on cancel).

Between the fork and the runtime, a fixed bash script runs as root with a fixed environment:

* on a hybrid host whose cgroup2 hierarchy lists a controller, crun refuses to start; in a
  mount namespace of its own, that hierarchy is hidden under an empty tmpfs (crun then sees a
  cgroup v1 host, and manages no cgroup anyway);
* the fds passed to the container (PMI_FD, a batch script's) are moved to 3, 4, ... (the
  runtime's ``--preserve-fds`` passes exactly 3..3+N-1: crun's own fds after them stay out);
* then setpriv drops to the user (uid, gid, groups, no new privileges) and execs the runtime.

Per task, the run directory holds ``oci/r<rank>/``: the configuration tether wrote
(``config.json``), the runtime's state (``--root``) and its log (``--log``, where the reason of
a container that could not start comes from). It is made by root and then handed to the user
(the runtime writes there); root afterwards only reads the log (no link followed, her own
regular file, bounded) and removes the tree: at the task's end, and with the run directory
(the agent's fallback path too, agent/effects.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from typing import Any

from tether.shared import container_spec

log = logging.getLogger(__name__)

#: where the runtime, bash, setpriv, unshare and mount are looked up (never the job's PATH)
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
UNIFIED = "/sys/fs/cgroup/unified"
#: variables whose value is an fd number passed to the task (moved, so renumbered)
FD_VARS = ("PMI_FD",)
MAX_LOG = 64 << 10


def hybrid_with_controllers() -> bool:
    """Is cgroup2 mounted beside v1 with a controller of its own (crun 1.8 refuses that)?"""
    try:
        with open(os.path.join(UNIFIED, "cgroup.controllers")) as f:
            return bool(f.read().strip())
    except OSError:
        return False


def _tool(name: str) -> str:
    """A program's path on ``SAFE_PATH`` (not shutil.which: shutil imports bz2 and lzma,
    whose libraries every supervisor would carry)."""
    for d in SAFE_PATH.split(":"):
        path = os.path.join(d, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise OSError(f"{name} is not installed on this node")


class Containers:
    """The container side of one step's launch (``spec["container"]``, checked by the agent)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.want: dict[str, Any] = spec["container"]
        self.name = runtime_of(spec)
        self.base = str(self.want["dir"])
        self.runtime = _tool(self.name)
        self.bash = _tool("bash")
        self.hide = self.name == "crun" and hybrid_with_controllers()
        self.is_root = os.geteuid() == 0
        if self.hide and not self.is_root:  # hiding the hierarchy takes a mount of root's
            raise OSError("crun refuses this host's cgroups (cgroup2 beside v1, with a "
                          "controller) and only an agent running as root hides them from it; "
                          "use --container-runtime runc")

    def wrap(self, rank: int, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...],
             who: dict[str, Any], cwd: str) -> tuple[list[str], dict[str, str], tuple[int, ...],
                                                     dict[str, Any]]:
        """What to start instead of ``argv`` for rank ``rank``: (argv, env, pass_fds, who)."""
        moved = {fd: 3 + i for i, fd in enumerate(pass_fds)}
        env = {k: (str(moved[int(v)]) if k in FD_VARS and v.isdigit() and int(v) in moved
                   else v) for k, v in env.items()}
        args = [_renumbered(a, moved) for a in argv]
        uid = int(self.spec.get("uid", os.getuid()))
        gid = int(self.spec.get("gid", os.getgid()))
        home = self.spec.get("home") or env.get("HOME")
        if not (isinstance(home, str) and os.path.isdir(home)):  # the passwd entry's: no home
            home = None
        cfg = container_spec.config(
            rootfs=self.want["rootfs"], args=args,
            env=container_spec.merged_env(self.want.get("env", []), env), cwd=cwd, uid=uid,
            gid=gid, home=home, mounts=self.want["mounts"],
            root_inside=container_spec.needs_root_inside(self.name,
                                                         bool(self.want.get("remap_root"))))
        top = self._make_dir(rank, cfg, uid, gid)
        cid = f"tether-{self.spec['job']}.{self.spec['attempt']}-{rank}"
        run = [self.runtime, "--root", os.path.join(top, "state"),
               f"--log={os.path.join(top, 'runtime.log')}", "--log-format=json"]
        if self.name == "crun":
            run.append("--cgroup-manager=disabled")
        run += ["run", "--preserve-fds", str(len(pass_fds)), "--bundle", top, cid]
        script = ["set -e"]
        if self.hide:
            script.append(f"{_tool('mount')} -t tmpfs -o ro,nosuid,nodev,noexec,size=4k "
                          f"tether-hide {UNIFIED}")
        if pass_fds:
            script.append(_remap(pass_fds))
        groups = [int(g) for g in self.spec.get("groups", [])]
        if self.is_root and who:
            drop = [_tool("setpriv"), f"--reuid={uid}", f"--regid={gid}",
                    f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
                    "--no-new-privs", "--"]
        else:
            drop = []
        script.append('exec "$@"')
        wrapped = [self.bash, "-c", "\n".join(script), "tether-container", *drop, *run]
        if self.hide:
            wrapped = [_tool("unshare"), "--mount", "--propagation", "slave", "--", *wrapped]
        # the runtime's own environment: nothing of the job's (root runs the first programs;
        # the container's variables are in config.json)
        return wrapped, {"PATH": SAFE_PATH}, pass_fds, {}

    def _make_dir(self, rank: int, cfg: dict[str, Any], uid: int, gid: int) -> str:
        os.makedirs(self.base, mode=0o711, exist_ok=True)
        top = os.path.join(self.base, f"r{rank}")
        remove_one(top)
        os.mkdir(top, 0o700)
        os.mkdir(os.path.join(top, "state"), 0o700)
        data = json.dumps(cfg).encode()
        fd = os.open(os.path.join(top, "config.json"),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if self.is_root:
                os.fchown(fd, uid, gid)
        finally:
            os.close(fd)
        if self.is_root:  # hers from now on: the runtime (running as her) writes its state
            os.chown(os.path.join(top, "state"), uid, gid)
            os.chown(top, uid, gid)
        return top


def runtime_of(spec: dict[str, Any]) -> str:
    return str(spec["container"].get("runtime") or container_spec.DEFAULT_RUNTIME)


def ended(spec: dict[str, Any], rank: int, status: int) -> tuple[int, str | None]:
    """A task was reaped with ``status``: for a container's runtime, the container process's
    own status (the runtime exits 128+N when signal N killed it) and, when the runtime itself
    failed (its log says why), that reason; the task's directory goes. Needs nothing but the
    spec: it holds across an upgrade's exec."""
    want = spec.get("container")
    if not isinstance(want, dict):
        return status, None
    top = os.path.join(str(want["dir"]), f"r{rank}")
    reason = None
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) != 0:
        error = runtime_error(os.path.join(top, "runtime.log"), int(spec.get("uid", os.getuid())))
        if error:
            reason = f"container runtime {runtime_of(spec)}: {error}"
        elif 128 < os.WEXITSTATUS(status) <= 128 + 64:
            status = os.WEXITSTATUS(status) - 128  # a wait status "killed by N"
    remove_one(top)
    return status, reason


def remove_one(path: str) -> None:
    """Remove a tree the user wrote in, by file descriptor, following no link she left there,
    errors ignored."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
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
            if depth >= 16:
                continue
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=dir_fd)
            try:
                _empty(sub, depth + 1)
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=dir_fd)


def runtime_error(path: str, uid: int) -> str | None:
    """The last error the runtime logged (JSON lines: {"msg", "level"}), or None. The file is
    the user's: opened without following a link, only a regular file she owns, bounded."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (os.geteuid() == 0 and st.st_uid != uid):
            return None
        data = os.pread(fd, MAX_LOG, max(0, st.st_size - MAX_LOG))
    except OSError:
        return None
    finally:
        os.close(fd)
    last = None
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("level") == "error" and isinstance(
                rec.get("msg"), str):
            last = rec["msg"]
    if last is None:
        return None
    return "".join(c if c.isprintable() else " " for c in last)[:240]


def _renumbered(arg: str, moved: dict[int, int]) -> str:
    """A batch script handed over as ``/proc/self/fd/N``: its number inside."""
    prefix = "/proc/self/fd/"
    if arg.startswith(prefix) and arg[len(prefix):].isdigit():
        new = moved.get(int(arg[len(prefix):]))
        if new is not None:
            return f"{prefix}{new}"
    return arg


def _remap(fds: tuple[int, ...]) -> str:
    """bash redirections that put ``fds`` at 3, 4, ... whatever their numbers now: each to a
    spare number above all of them first, then down, then the spares and the rest closed."""
    top = max(*fds, 3 + len(fds)) + 1
    spare = [top + i for i in range(len(fds))]
    targets = [3 + i for i in range(len(fds))]
    parts = [f"{s}<&{fd}" for s, fd in zip(spare, fds, strict=True)]
    parts += [f"{t}<&{s}" for t, s in zip(targets, spare, strict=True)]
    parts += [f"{s}<&-" for s in spare]
    parts += [f"{fd}<&-" for fd in fds if fd not in targets]
    return "exec " + " ".join(parts)
