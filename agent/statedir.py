"""The agent's state directory: refused unless it is the agent's own and nobody else can write
it or anything in it (I/O).

The agent runs as root and writes in this directory (a lock file it truncates, the database, the
supervisors' log, run directories it removes). A directory another user created first (the
README's example lives in the world-writable /tmp), or one another user can write, would let
that user plant links that root then follows (``agent.lock`` -> /etc/passwd, truncated). So:

- every directory above it must belong to root or the agent's uid and be writable by nobody
  else, unless it is sticky (/tmp): others cannot rename or replace what they do not own there;
- the directory itself must belong to the agent's uid and not be writable by group or others;
- every file the agent keeps there, if it exists, must not be a link, must belong to the agent's
  uid, must not be writable by others, and must have no other hard link;
- the lock file is opened relative to the directory's fd, with O_NOFOLLOW.

Anything else is refused with a one-line error naming the path and the problem.
"""

from __future__ import annotations

import array
import fcntl
import os
import stat

#: What the agent keeps directly in its state directory.
ENTRIES = ("agent.lock", "agent.sock", "template.sock", "tether.db", "tether.db-wal",
           "tether.db-shm", "supervisors.log", "run")


#: ext2/3/4's "top of a directory hierarchy" flag (``chattr +T``) and the ioctls that read and
#: write the flags (linux/fs.h: FS_TOPDIR_FL, FS_IOC_GETFLAGS, FS_IOC_SETFLAGS)
FS_TOPDIR_FL = 0x00020000
_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602


class UnsafeStateDir(Exception):
    pass


def _who(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}"


def check_ancestors(path: str) -> None:
    me = os.geteuid()
    real = os.path.realpath(path)
    parent = os.path.dirname(real)
    while True:
        st = os.stat(parent)
        if st.st_uid not in (0, me):
            raise UnsafeStateDir(f"{parent}, above the state directory {path}, belongs to "
                                 f"another user ({_who(st)}): refusing it")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafeStateDir(f"{parent}, above the state directory {path}, can be written "
                                 f"by others ({_who(st)}): refusing it")
        if parent == "/":
            return
        parent = os.path.dirname(parent)


def open_state_dir(path: str) -> int:
    """Make ``path`` if missing, check it and what is in it; return an O_DIRECTORY fd on it."""
    check_ancestors(path)
    os.makedirs(path, mode=0o755, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UnsafeStateDir(f"state directory {path} belongs to uid {st.st_uid}, not to "
                                 f"this agent's uid {os.geteuid()} ({_who(st)}): refusing it")
        if st.st_mode & 0o022:
            raise UnsafeStateDir(f"state directory {path} can be written by others "
                                 f"({_who(st)}): refusing it")
        for name in ENTRIES:
            check_entry(fd, path, name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_entry(dir_fd: int, dir_path: str, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    where = os.path.join(dir_path, name)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeStateDir(f"{where} is a symbolic link: refusing the state directory")
    if st.st_uid != os.geteuid():
        raise UnsafeStateDir(f"{where} belongs to uid {st.st_uid}, not to this agent's uid "
                             f"{os.geteuid()}: refusing the state directory")
    if st.st_mode & 0o022 and not stat.S_ISSOCK(st.st_mode):
        raise UnsafeStateDir(f"{where} can be written by others ({_who(st)}): refusing the "
                             "state directory")
    if stat.S_ISREG(st.st_mode) and st.st_nlink != 1:
        raise UnsafeStateDir(f"{where} has {st.st_nlink} hard links: refusing the state "
                             "directory")
    if name == "run" and not stat.S_ISDIR(st.st_mode):
        raise UnsafeStateDir(f"{where} is not a directory: refusing the state directory")


def open_lock(dir_fd: int, dir_path: str) -> int:
    """``agent.lock``, opened without following a link and checked again on the open file."""
    name = "agent.lock"
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     0o600, dir_fd=dir_fd)
    except OSError as exc:
        raise UnsafeStateDir(f"cannot open {os.path.join(dir_path, name)}: "
                             f"{exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise UnsafeStateDir(f"{os.path.join(dir_path, name)} is not a plain file of this "
                             f"agent's own ({_who(st)}, {st.st_nlink} links): refusing it")
    return fd


def make_run_root(dir_fd: int) -> bool:
    """``run/`` (the run directories' parent), made if missing and marked as the top of a
    directory hierarchy; False where the file system has no such mark (best effort).

    Why: with the mark, ext4's directory allocator (Orlov) spreads the run directories over
    the file system's block groups instead of putting each in ``run/``'s own group, and the
    files a step creates go with its directory. On ext4 without a journal (this project's
    development VMs) every new inode is looked for past each inode of its group freed in the
    last 60-360 s (the kernel's ``recently_deleted``): with every run directory in one group,
    a node that creates and removes ~10 files per job paid ~0.5 ms of kernel CPU per file
    (bench/README.md). Nothing else changes: lookups and the paths are the same."""
    try:
        os.mkdir("run", 0o755, dir_fd=dir_fd)
    except FileExistsError:
        pass
    fd = os.open("run", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                 dir_fd=dir_fd)
    try:
        flags = array.array("i", [0])  # the kernel reads and writes an int, whatever the name
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        if not flags[0] & FS_TOPDIR_FL:
            flags[0] |= FS_TOPDIR_FL
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, flags)
            fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        return bool(flags[0] & FS_TOPDIR_FL)
    except OSError:  # not ext2/3/4 (ENOTTY, EOPNOTSUPP), or flags it refuses: no matter
        return False
    finally:
        os.close(fd)
