"""Starting a supervisor detached from the agent (I/O).

The agent takes the run directory's lock *before* the spawn and hands the locked fd to the
supervisor: there is no moment in which a live supervisor's directory looks abandoned, so a
restarted agent can never take a starting supervisor for a dead one and run its job twice.

Detaching: ``/bin/sh`` is started in a new session and backgrounds the supervisor, printing its
pid, then exits; the supervisor is re-parented away from the agent (to init or the nearest
subreaper), in a session of its own, not a session leader, with stdin on /dev/null and stdout and
stderr appended to ``supervisors.log``. Nothing sent to the agent or its process group reaches it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from typing import Any

from tether.shared import records
from tether.shared.paths import Layout, RunDir

_DETACH = '"$@" </dev/null >&2 & echo $!'
SPAWN_TIMEOUT = 10.0


class SpawnError(Exception):
    pass


def spawn_supervisor(layout: Layout, rd: RunDir, spec: dict[str, Any]) -> int:
    """Create the run directory, write the spec, start the supervisor; return its pid."""
    os.makedirs(layout.run_root, mode=0o755, exist_ok=True)
    if os.path.lexists(rd.path):  # left by a crash before this attempt's spawn
        shutil.rmtree(rd.path)
    os.mkdir(rd.path, 0o711)
    os.mkdir(rd.ctl, 0o700)  # the supervisor's ZeroMQ socket: this uid's only
    lock_fd = os.open(rd.lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600)
    log_fd = -1
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        records.atomic_write_json(rd.spec, spec)
        log_fd = os.open(layout.supervisor_log,
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                         0o600)
        env = {k: v for k, v in os.environ.items()
               if k.startswith(("PYTHON", "LANG", "LC_", "TETHER_"))}
        env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
        argv = [sys.executable, "-I", "-m", "tether.supervisor", "--run-dir", rd.path,
                "--lock-fd", str(lock_fd)]
        try:
            proc = subprocess.Popen(
                ["/bin/sh", "-c", _DETACH, "tether-spawn", *argv],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_fd,
                pass_fds=(lock_fd,), start_new_session=True, cwd="/", env=env,
            )
            out, _ = proc.communicate(timeout=SPAWN_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise SpawnError(f"the shell starting the supervisor for {rd.path} did not finish "
                             f"within {SPAWN_TIMEOUT:g}s") from None
        except OSError as exc:
            raise SpawnError(f"cannot start the supervisor for {rd.path}: {exc}") from None
        try:
            return int(out.strip())
        except ValueError:
            raise SpawnError(f"supervisor spawn for {rd.path} printed no pid") from None
    finally:
        os.close(lock_fd)
        if log_fd >= 0:
            os.close(log_fd)
