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
    remove_cgroups_under(state)
    return len(victims)


class ScratchAgent:
    """An agent on a fresh temporary state directory, for one benchmark run."""

    def __init__(self, prefix: str, cpus: int, extra: list[str] | None = None) -> None:
        import subprocess
        import sys
        import tempfile
        import time

        self.base = tempfile.mkdtemp(dir="/tmp", prefix=prefix)
        self.state = os.path.join(self.base, "s")
        self.work = os.path.join(self.base, "w")
        os.makedirs(self.work)
        self.env = dict(os.environ, TETHER_STATE_DIR=self.state)
        self.tether = [sys.executable, "-m", "tether.cli.main"]
        self._log = open(os.path.join(self.base, "agent.log"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([*self.tether, "agent", "--cpus", str(cpus),
                                      "--oversubscribe", *(extra or [])], env=self.env,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 20
        while subprocess.run([*self.tether, "status"], env=self.env,
                             capture_output=True).returncode:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise SystemExit("the agent did not start")
            time.sleep(0.05)

    def close(self) -> None:
        import shutil

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait()
        self._log.close()
        kill_tree(self.state)
        remove_cgroups(self.state)
        shutil.rmtree(self.base, ignore_errors=True)


def remove_cgroups_under(root: str) -> None:
    """The steps' cgroups of every agent state directory at or below ``root`` (one that holds
    an ``agent.lock``): a benchmark's agents are gone, what they left in cgroupfs goes too."""
    for dirpath, _dirs, files in os.walk(root):
        if "agent.lock" in files:
            remove_cgroups(os.path.abspath(dirpath))


def remove_cgroups(state: str) -> None:
    """The steps' cgroups an agent on ``state`` made (its default base), and the base."""
    from tether.agent import contain

    contain.remove_all(contain.default_base(state))
