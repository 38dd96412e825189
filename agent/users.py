"""Jobs as other users: who the user is, and whether that user can write where the job will.

The check runs *as the user* (a short /bin/sh with the user's uid, gid and groups), so it asks
the kernel exactly the question the launch will: root's own view of permissions is irrelevant.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from dataclasses import dataclass

from tether.shared.errors import BadRequest

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


def check_access(user: User, workdir: str, outputs: list[str]) -> None:
    """Refuse, with the reason, a job whose user could not enter ``workdir`` or write outputs."""
    try:
        res = subprocess.run(
            ["/bin/sh", "-c", _CHECK, "tether-check", workdir, *outputs],
            user=user.uid, group=user.gid, extra_groups=list(user.groups),
            capture_output=True, text=True, timeout=10, cwd="/", env={"PATH": "/usr/bin:/bin"},
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise BadRequest(f"cannot check what user {user.name} may write: {exc}") from None
    if res.returncode != 0:
        why = res.stdout.strip() or res.stderr.strip() or f"exit {res.returncode}"
        raise BadRequest(f"user {user.name}: {why}")
