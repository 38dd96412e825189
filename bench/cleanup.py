"""Kill everything a benchmark started under one state directory: the supervisors (found by
their process title, which names the run directory) and every process of their sessions."""

from __future__ import annotations

import os
import signal


def kill_tree(state: str) -> int:
    marker = state.encode()
    sessions: set[int] = set()
    victims: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker not in f.read():
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                sessions.add(int(f.read().rsplit(b")", 1)[1].split()[3]))
        except (OSError, IndexError, ValueError):
            continue
        victims.add(int(name))
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[3]) in sessions:
                    victims.add(int(name))
        except (OSError, IndexError, ValueError):
            continue
    victims.discard(os.getpid())
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return len(victims)
