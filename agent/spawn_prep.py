"""Preparing a supervisor's spawn: its run directory and spec, the run directory's lock, the
supervisors' log; and ``SpawnError``, what a spawn that cannot be made raises.

Apart from ``spawn.py`` because this is the file system side of a spawn, most of it done on the
spawner's worker thread (``prepare``: mkdir, open, rename and rmtree wait for the file system,
which a busy disk makes milliseconds each), never on the agent's loop.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from typing import Any

from tether.shared import records
from tether.shared.paths import Layout, RunDir


class SpawnError(Exception):
    pass


def prepare(layout: Layout, rd: RunDir, spec: dict[str, Any]) -> None:
    """Create the run directory and write the spec before anything starts."""
    os.makedirs(layout.run_root, mode=0o755, exist_ok=True)
    if os.path.lexists(rd.path):  # left by a crash before this attempt's spawn
        shutil.rmtree(rd.path)
    os.mkdir(rd.path, 0o711)
    os.mkdir(rd.ctl, 0o700)  # the supervisor's ZeroMQ socket: this uid's only
    fd = os.open(rd.lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    os.close(fd)
    script = spec.pop("script_data", None)
    if script is not None:  # a batch script's copy (agent/batch.py): root's, in root's directory
        fd = os.open(rd.script, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(script)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        spec["script"] = rd.script
    # Not fsync'd (two fsyncs off every launch): its only reader is the supervisor, which a
    # power cut ends too; the run directory and lock are what a restarted agent looks at.
    records.atomic_write_json(rd.spec, spec, durable=False)


def hold(state_dir: str) -> None:
    """The ``hold-spawn-prep`` fault: say so, then wait for the test's go (worker thread)."""
    with open(os.path.join(state_dir, "prep.held"), "w"):
        pass
    while not os.path.exists(os.path.join(state_dir, "prep.go")):
        time.sleep(0.02)


def lock(rd: RunDir) -> int:
    """The run directory's lock, taken (``BlockingIOError`` if someone holds it)."""
    fd = os.open(rd.lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_log(layout: Layout) -> int:
    return os.open(layout.supervisor_log,
                   os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
