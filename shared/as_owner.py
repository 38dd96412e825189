"""A job's file opened for reading with no more rights than its owner has (``open_as_reader``):
the step client's fallback when a supervisor goes away mid-follow reads the rest of the output
files itself. Apart from ``step_client.py``: only that fallback needs it (imported when it runs),
and it is where a client running as root acts as another user (a forked child that becomes her).
"""

from __future__ import annotations

import os
import stat


def open_as_reader(path: str, owner: int) -> int:
    """``path`` opened read-only with the rights of the calling user, and never more than the
    job's owner has: root reading another user's output does so in a forked child that has
    become that user (the path is the user's to point anywhere, /etc/shadow included)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    if os.geteuid() != 0 or owner == 0:
        return _checked_reader(os.open(path, flags), path)
    import contextlib
    import pwd
    import socket

    try:
        pw = pwd.getpwuid(owner)
        gid, groups = pw.pw_gid, os.getgrouplist(pw.pw_name, pw.pw_gid)
    except KeyError:
        gid, groups = owner, []
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: only os calls, then _exit
        code = 1
        try:
            ours.close()
            os.setgroups(groups)
            os.setresgid(gid, gid, gid)
            os.setresuid(owner, owner, owner)
            socket.send_fds(theirs, [b"ok"], [os.open(path, flags)])
            code = 0
        except OSError as exc:
            with contextlib.suppress(OSError):
                theirs.send(f"{exc.strerror}".encode())
        finally:
            os._exit(code)
    theirs.close()
    try:
        ours.settimeout(10)
        msg, fds, _, _ = socket.recv_fds(ours, 1024, 1)
    finally:
        ours.close()
        os.waitpid(pid, 0)
    if msg != b"ok" or not fds:
        raise OSError(f"{path}: {msg.decode(errors='replace') or 'cannot open it'} "
                      f"(as uid {owner})")
    return _checked_reader(fds[0], path)


def _checked_reader(fd: int, path: str) -> int:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return fd
