"""The cold way to start a detached process: ``/bin/sh``, started in a new session,
backgrounds it with stdin on /dev/null and stderr on ``supervisors.log`` and prints its pid.

Used for every supervisor when the template is missing or broken (``start_supervisor``: the
shell's output is read by the agent's poller, never waited for) and for the template itself
(``detach``, at agent start or after it died: a blocking wait for the pid). Apart from
``spawn.py`` because it is the one place that knows the shell's contract: the process it
starts is re-parented away from the agent (to init or the nearest subreaper), in a session of
its own, not its leader, so nothing sent to the agent or its process group reaches it.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tether.agent.spawn_prep import SpawnError, open_log
from tether.shared.paths import Layout, RunDir

_DETACH = '"$@" </dev/null >&2 & echo $!'
#: How long the detaching shell may take to print the supervisor's pid.
SPAWN_TIMEOUT = 10.0


def start_supervisor(layout: Layout, rd: RunDir, lock_fd: int, ready_w: int,
                     env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start the shell that backgrounds ``rd``'s supervisor with the locked ``lock_fd`` and
    the ready pipe's ``ready_w``; the shell's stdout (non-blocking) will carry its pid."""
    argv = [sys.executable, "-I", "-m", "tether.supervisor", "--run-dir", rd.path,
            "--lock-fd", str(lock_fd), "--ready-fd", str(ready_w)]
    log_fd = open_log(layout)
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", _DETACH, "tether-spawn", *argv],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_fd,
            pass_fds=(lock_fd, ready_w), start_new_session=True, cwd="/", env=env,
        )
    except OSError as exc:
        raise SpawnError(f"cannot start the supervisor for {rd.path}: {exc}") from None
    finally:
        os.close(log_fd)
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    return proc


def reap(proc: subprocess.Popen[bytes]) -> None:
    """The shell printed and closed its stdout: it is exiting (killed if it lingers)."""
    try:
        proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def detach(argv: list[str], layout: Layout, pass_fds: tuple[int, ...]) -> int:
    """Start ``argv`` detached (new session, re-parented away); wait for the shell's pid."""
    log_fd = open_log(layout)
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", _DETACH, "tether-spawn", *argv],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_fd,
            pass_fds=pass_fds, start_new_session=True, cwd="/",
            env={k: v for k, v in os.environ.items()
                 if k.startswith(("PYTHON", "LANG", "LC_", "TETHER_", "PATH"))},
        )
    finally:
        os.close(log_fd)
    try:
        out, _ = proc.communicate(timeout=SPAWN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SpawnError(f"the detaching shell did not finish within {SPAWN_TIMEOUT:g}s") \
            from None
    try:
        return int(out.strip())
    except ValueError:
        raise SpawnError("the detaching shell printed no pid") from None
