"""Jobs as other users: who the user is, and whether that user can write where the job will.

The check runs *as the user* (a short /bin/sh with the user's uid, gid and groups), so it asks
the kernel exactly the question the launch will: root's own view of permissions is irrelevant.
The user owns that shell, so she can stop it (SIGSTOP) or slow it (a hung file system of hers):
it runs in a session of its own and has a deadline, after which its whole process group is
SIGKILLed and the submission refused, naming the deadline (agent/checks.py bounds how many run).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from tether.shared.errors import BadRequest, StateError

#: seconds a check run as the user may take when the caller gives no deadline
CHECK_TIMEOUT = 10.0

#: the checks running now (their threads add and remove them): killed when the agent stops,
#: so that none it started outlives it (a stopped one would, for good)
_running: set[subprocess.Popen[str]] = set()
_running_lock = threading.Lock()

#: sh script: $1 workdir, then the output paths. Prints the first problem and exits 1.
_CHECK = r'''
cd -- "$1" 2>/dev/null || {
    if [ -d "$1" ]; then echo "cannot enter the working directory $1"
    else echo "working directory $1 does not exist or is not a directory"; fi
    exit 1
}
shift
for f in "$@"; do
    if [ -e "$f" ] || [ -L "$f" ]; then
        [ -f "$f" ] && [ ! -L "$f" ] || [ -c "$f" ] || { echo "$f is not a regular file"; exit 1; }
        [ -w "$f" ] || { echo "cannot write $f"; exit 1; }
    else
        d=$(dirname -- "$f")
        [ -d "$d" ] || { echo "output file $f: its directory does not exist"; exit 1; }
        { [ -w "$d" ] && [ -x "$d" ]; } || { echo "cannot create $f in $d"; exit 1; }
    fi
done
'''


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


def lookup(name: str) -> User:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise BadRequest(f"no such user {name!r}") from None
    groups = tuple(sorted(set(os.getgrouplist(pw.pw_name, pw.pw_gid))))
    return User(pw.pw_name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir)


def by_uid(uid: int, gid: int | None = None) -> User:
    """The user the kernel says a peer is (its uid, and its primary gid if given)."""
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        raise BadRequest(f"uid {uid} has no entry in the user database") from None
    primary = pw.pw_gid if gid is None else gid
    groups = tuple(sorted(set(os.getgrouplist(pw.pw_name, primary))))
    return User(pw.pw_name, pw.pw_uid, primary, groups, pw.pw_dir)


def current() -> User:
    pw = pwd.getpwuid(os.getuid())
    return User(pw.pw_name, pw.pw_uid, pw.pw_gid, tuple(sorted(set(os.getgroups()))), pw.pw_dir)


def check_own_access(workdir: str, outputs: list[str]) -> None:
    """The same check for a job of the agent's own user: this process's view is the job's."""
    if not os.path.isdir(workdir):
        raise BadRequest(f"working directory {workdir} does not exist or is not a directory")
    for path in outputs:
        if not os.path.isdir(os.path.dirname(path)):
            raise BadRequest(f"output file {path}: its directory does not exist")


def check_access(user: User, workdir: str, outputs: list[str], *,
                 timeout: float = CHECK_TIMEOUT, deadline: float | None = None) -> None:
    """Refuse, with the reason, a job whose user could not enter ``workdir`` or write outputs.
    Past ``deadline`` (``time.monotonic()``; default ``timeout`` seconds from now) the check's
    process group is killed and the submission refused, naming ``timeout``."""
    if deadline is None:
        deadline = time.monotonic() + timeout
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", _CHECK, "tether-check", workdir, *outputs],
            user=user.uid, group=user.gid, extra_groups=list(user.groups),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd="/", env={"PATH": "/usr/bin:/bin"},
            # a group of its own: what the shell starts (dirname) is killed with it
            start_new_session=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise BadRequest(f"cannot check what user {user.name} may write: {exc}") from None
    with _running_lock:
        _running.add(proc)
    try:
        out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise StateError(
            f"user {user.name}: the check that the job can enter {workdir} and write its "
            f"outputs did not finish within {timeout:g}s (a hung file system, or "
            "its processes stopped); its processes were killed and the job was not "
            "submitted") from None
    finally:
        with _running_lock:
            _running.discard(proc)
    if proc.returncode != 0:
        why = out.strip() or err.strip() or f"exit {proc.returncode}"
        raise BadRequest(f"user {user.name}: {why}")


def kill_checks() -> None:
    """SIGKILL the process group of every check still running (the agent is stopping)."""
    with _running_lock:
        procs = list(_running)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def _kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the check's process group (stopped ones die too) and reap its shell. Its pipes
    are closed unread: a process of the group that outlived the kill must not keep this
    thread waiting for their end."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    proc.wait()  # SIGKILL ends even a stopped process; one stuck in the kernel holds its slot
