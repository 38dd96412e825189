"""Real local users for tests: created with unique names, removed in teardown, and the tether CLI
and small scripts run as them (through an interpreter every user can reach)."""

from __future__ import annotations

import os
import pwd
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tests.helpers import Node, foreign_python


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str


@contextmanager
def made_users(n: int) -> Iterator[list[User]]:
    """``n`` fresh users (``tt`` + 6 hex characters), each with its own group; always removed."""
    made: list[str] = []
    try:
        out = []
        for _ in range(n):
            name = "tt" + secrets.token_hex(3)
            subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell",
                            "/usr/sbin/nologin", name], check=True, capture_output=True)
            made.append(name)
            pw = pwd.getpwnam(name)
            out.append(User(name, pw.pw_uid, pw.pw_gid, pw.pw_dir))
        yield out
    finally:
        for name in made:
            remove_user(name)


def remove_user(name: str, within: float = 5.0) -> bool:
    """``userdel``, until it works. A user who still has processes (exit 8) has them killed
    first; one still in use after ``within`` seconds (a zombie its test's agent has not reaped
    yet: the fixture that made the user is torn down before the node's) is left to
    ``remove_left_users`` at the session's end, after every node's clean-up. True if removed."""
    deadline = time.monotonic() + within
    while True:
        res = subprocess.run(["userdel", name], capture_output=True, text=True)
        if res.returncode in (0, 6):  # removed, or no such user
            return True
        if time.monotonic() > deadline:
            if res.returncode == 8:
                LEFT.append(name)
                return False
            raise AssertionError(f"test user {name} could not be removed: userdel exit "
                                 f"{res.returncode}: {res.stderr.strip()}")
        if res.returncode == 8:
            kill_processes_of(pwd.getpwnam(name).pw_uid)
        time.sleep(0.05)


#: users still in use when their test ended: removed at the session's end
LEFT: list[str] = []


def remove_left_users() -> list[str]:
    """The session's end (conftest.py): remove the users left in use; those that still cannot
    be removed, by name."""
    pending = list(LEFT)
    LEFT.clear()
    failed = [name for name in pending if not remove_user(name, within=15.0)]
    LEFT.clear()
    return failed


def kill_processes_of(uid: int) -> None:
    """SIGKILL every process whose real or effective uid is ``uid``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                uids = next(line for line in f if line.startswith("Uid:")).split()[1:3]
            if str(uid) in uids:
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, StopIteration):
            continue


def run_as(user: User, argv: list[str], *, env: dict[str, str] | None = None,
           cwd: str = "/", timeout: float = 60, umask: int = -1,
           ) -> subprocess.CompletedProcess[str]:
    python, penv = foreign_python()
    full = dict(penv, PATH="/usr/bin:/bin", HOME=user.home, USER=user.name, LOGNAME=user.name,
                **(env or {}))
    return subprocess.run([*python, *argv], user=user.uid, group=user.gid, extra_groups=[],
                          capture_output=True, text=True, cwd=cwd, env=full, timeout=timeout,
                          umask=umask)


def cli_as(user: User, node: Node, *args: str, env: dict[str, str] | None = None,
           cwd: str = "/", timeout: float = 60,
           umask: int = -1) -> subprocess.CompletedProcess[str]:
    return run_as(user, ["-m", "tether.cli.main", *args],
                  env=dict(env or {}, TETHER_STATE_DIR=node.state), cwd=cwd, timeout=timeout,
                  umask=umask)


def ok_as(user: User, node: Node, *args: str, **kw: object) -> str:
    res = cli_as(user, node, *args, **kw)  # type: ignore[arg-type]
    assert res.returncode == 0, f"tether {' '.join(args)} as {user.name}: rc={res.returncode} " \
                                f"{res.stderr}\n{node.logs()}"
    return res.stdout


def shared(node: Node) -> None:
    """Let every user reach the node's state dir (tests' temp dirs start 0700)."""
    os.chmod(node.dir, 0o755)


def home_for(node: Node, user: User, name: str | None = None, mode: int = 0o755) -> str:
    """A directory of ``user``'s own under the node's temp dir."""
    path = os.path.join(node.dir, name or user.name)
    os.mkdir(path)
    os.chown(path, user.uid, user.gid)
    os.chmod(path, mode)
    return path


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")
