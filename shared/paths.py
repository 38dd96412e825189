"""The spool layout: the one place that names the files the agent and supervisors share.

    <state_dir>/agent.lock          flock held by the one live agent
    <state_dir>/agent.sock          the agent's door (plain AF_UNIX, any local user), for the CLI
    <state_dir>/tether.db           SQLite: intent and history (agent only)
    <state_dir>/supervisors.log     supervisors' stderr, appended
    <state_dir>/template.sock       the warm supervisor template (SOCK_SEQPACKET, 0600)
    <state_dir>/topology.xml        the node's hwloc topology, for MPI ranks to load (0644)
    <state_dir>/run/<job>.<attempt>/
        lock       flock: taken by the agent before spawning, inherited and held by the supervisor
        spec.json  what to run, written by the agent before the spawn
        sock       the supervisor's door (plain AF_UNIX, any local user)
        ctl/       0700: only the agent's uid may enter
            sock   the supervisor's ZeroMQ ROUTER, for the agent (supervisor/ctl.py; 0.5-0.6
                   served it with a door answering ZMTP) (tether 0.1: ``sock`` above)
        manifest.json  identities and phase, written by the supervisor (ready, launching, running)
        exit.json  the exit sentinel, written once the last task is reaped

A run directory is named by (job, attempt), so a relaunch never reuses the directory, lock or
socket of an earlier attempt.
"""

from __future__ import annotations

import os

from tether.shared.frozen import Frozen

#: sizeof(sockaddr_un.sun_path) - 1 on Linux; libzmq refuses longer ipc paths.
IPC_PATH_MAX = 107

#: Widest run directory name we ever create, used to check a state dir up front.
_WORST_RUN_NAME = "18446744073709551615.4294967295"

#: a run directory's name, as ``job.attempt`` (compiled on first use: ``re`` and the ``enum``
#: it imports cost every CLI run ~3 ms, and only the agent lists run directories)
_RUN_NAME = r"^([1-9][0-9]{0,18})\.([1-9][0-9]{0,9})$"


class PathTooLong(ValueError):
    pass


def check_ipc_path(path: str) -> str:
    size = len(os.fsencode(path))
    if size > IPC_PATH_MAX:
        raise PathTooLong(
            f"socket path {path!r} is {size} bytes, over the {IPC_PATH_MAX}-byte limit of "
            "unix sockets; use a shorter --state-dir"
        )
    return path


def endpoint(path: str) -> str:
    return "ipc://" + check_ipc_path(path)


class RunDir(Frozen):
    __slots__ = ("path", "job", "attempt")
    path: str
    job: int
    attempt: int

    def __init__(self, path: str, job: int, attempt: int) -> None:
        self._init(path=path, job=job, attempt=attempt)

    @property
    def lock(self) -> str:
        return os.path.join(self.path, "lock")

    @property
    def spec(self) -> str:
        return os.path.join(self.path, "spec.json")

    @property
    def sock(self) -> str:
        return os.path.join(self.path, "sock")

    @property
    def ctl(self) -> str:
        return os.path.join(self.path, "ctl")

    @property
    def ctl_sock(self) -> str:
        return os.path.join(self.path, "ctl", "sock")

    def agent_sock(self) -> str:
        """Where the agent reaches this supervisor: ``ctl/sock``, or for a supervisor of tether
        0.1 (no ``ctl/``), ``sock``."""
        return self.ctl_sock if os.path.isdir(self.ctl) else self.sock

    @property
    def manifest(self) -> str:
        return os.path.join(self.path, "manifest.json")

    @property
    def sentinel(self) -> str:
        return os.path.join(self.path, "exit.json")

    @property
    def script(self) -> str:
        """A batch job's script, as submitted (the supervisor hands it to the tasks)."""
        return os.path.join(self.path, "script")

    @property
    def suspension(self) -> str:
        """The agent's account of the step's suspensions, for its time limit (the agent
        freezes the step; the supervisor does not see it)."""
        return os.path.join(self.path, "suspension.json")


class Layout(Frozen):
    __slots__ = ("state_dir",)
    state_dir: str

    def __init__(self, state_dir: str) -> None:
        self._init(state_dir=state_dir)

    @property
    def lock(self) -> str:
        return os.path.join(self.state_dir, "agent.lock")

    @property
    def sock(self) -> str:
        return os.path.join(self.state_dir, "agent.sock")

    @property
    def db(self) -> str:
        return os.path.join(self.state_dir, "tether.db")

    @property
    def cluster_marker(self) -> str:
        """Present while the agent is a cluster's member (it names the node): job ids on this
        node's command line are then the cluster's."""
        return os.path.join(self.state_dir, "cluster.json")

    @property
    def cluster_lease(self) -> str:
        """A cluster member's lease (shared/lease.py): renewed after each heartbeat the
        database accepted; its cluster steps end their tasks once it is too old."""
        return os.path.join(self.state_dir, "cluster-lease.json")

    @property
    def template_sock(self) -> str:
        return os.path.join(self.state_dir, "template.sock")

    @property
    def topology(self) -> str:
        return os.path.join(self.state_dir, "topology.xml")

    @property
    def supervisor_log(self) -> str:
        return os.path.join(self.state_dir, "supervisors.log")

    @property
    def run_root(self) -> str:
        return os.path.join(self.state_dir, "run")

    def run_dir(self, job: int, attempt: int) -> RunDir:
        return RunDir(os.path.join(self.run_root, f"{job}.{attempt}"), job, attempt)

    def check(self) -> None:
        """Fail early, with the reason, if a socket path in this layout would be too long."""
        check_ipc_path(self.sock)
        check_ipc_path(os.path.join(self.run_root, _WORST_RUN_NAME, "ctl", "sock"))

    def run_dirs(self) -> list[RunDir]:
        """Every well-named run directory, ordered by (job, attempt). Other names are ignored."""
        try:
            names = os.listdir(self.run_root)
        except FileNotFoundError:
            return []
        import re

        found = []
        for name in names:
            m = re.match(_RUN_NAME, name)
            if m:
                found.append(self.run_dir(int(m.group(1)), int(m.group(2))))
        return sorted(found, key=lambda r: (r.job, r.attempt))


#: The node's agent (root's), which every local user submits to.
SYSTEM_STATE_DIR = "/var/lib/tether"


def default_state_dir() -> str:
    """``TETHER_STATE_DIR``, else /var/lib/tether for root and for every user when the node's
    agent serves there, else the user's XDG state directory (an agent of her own)."""
    env = os.environ.get("TETHER_STATE_DIR")
    if env:
        return env
    if os.geteuid() == 0 or os.path.exists(os.path.join(SYSTEM_STATE_DIR, "agent.sock")):
        return SYSTEM_STATE_DIR
    xdg = os.environ.get("XDG_STATE_HOME")
    base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "tether")
