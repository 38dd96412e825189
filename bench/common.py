"""Kill everything a benchmark started under one state directory: the supervisors (found by
their process title, which names the run directory) and every process of their sessions."""

from __future__ import annotations

import os
import signal


def naming(path: str) -> list[int]:
    """Live processes whose command line names ``path`` (zombies aside)."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if path.encode() not in f.read():
                    continue
        except OSError:
            continue
        if stat_fields(int(name))[:1] not in ([b"Z"], [b"X"], []):
            found.append(int(name))
    return found


def stat_fields(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat after the command (state, ppid, pgrp, session, ...)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


def kill_tree(state: str, sessions: set[int] | None = None) -> int:
    """SIGKILL the agent, template and supervisors of one state directory (their command lines
    name it) and every process of their sessions, each process group at once first (a task's
    shell and its children together: killed one by one, a shell whose child died first would
    run on for a moment), then remove the steps' cgroups. ``sessions``: those found so far, kept
    by a caller that kills again (a task outlives its supervisor's title). Returns how many
    processes were found."""
    sessions = set() if sessions is None else sessions
    named = naming(state)
    sessions |= {int(f[3]) for p in named if len(f := stat_fields(p)) > 3}
    victims = set(named)
    groups = set()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            f = stat_fields(int(name))
            if len(f) > 3 and f[0] not in (b"Z", b"X") and int(f[3]) in sessions:
                victims.add(int(name))
                groups.add(int(f[2]))
    groups.discard(os.getpgrp())
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass
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
