"""A door's listening socket: bound at its path (mode 0666), accepted from with the kernel's
credentials of each peer, and unlinked only while it is still the socket bound here.

Apart from ``door.py`` because this is about the path and the listening socket alone; the
door decides what to do with each connection (its caps, ``door_caps.py``) and serves it.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from collections.abc import Iterator

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

#: Who connected, from the kernel: the socket, then pid, uid and gid of the process that
#: called connect() (never anything in a frame).
Accepted = tuple[socket.socket, int, int, int]


class Listener:
    def __init__(self, path: str, listen_fd: int | None = None) -> None:
        self.path = path
        # a listening socket the caller keeps (across an exec, say) is used through a copy
        self.sock = (_bind(path) if listen_fd is None else
                     socket.socket(fileno=os.dup(listen_fd)))
        self.sock.setblocking(False)
        self.bound_ino = os.stat(path).st_ino
        #: why the last ``accept()`` stopped early: out of fds or memory (None: it did not)
        self.full: str | None = None

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> Iterator[Accepted]:
        """The connections waiting, with their peers' credentials, at most 64 a call (the
        loop has other work). When the process or the system is out of fds or memory it
        stops and says why in ``full``."""
        self.full = None
        for _ in range(64):
            try:
                sock, _addr = self.sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.full = str(exc.strerror)
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EINTR, errno.EPROTO):
                    continue
                raise
            sock.setblocking(False)
            try:
                pid, uid, gid = _CRED.unpack(sock.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            except OSError:
                sock.close()
                continue
            yield sock, pid, uid, gid

    def close(self, unlink: bool = True) -> None:
        """Close the socket; ``unlink`` the path (if it is still the socket bound here) unless
        the caller keeps the listening socket for a successor."""
        self.sock.close()
        if not unlink:
            return
        try:  # never unlink a socket someone else bound at our path since
            if os.stat(self.path).st_ino == self.bound_ino:
                os.unlink(self.path)
        except OSError:
            pass


def listen_socket(path: str) -> int:
    """A door's listening socket at ``path``, as an fd the caller owns (and may keep across
    an exec: ``Door(listen_fd=...)`` works on a copy)."""
    return _bind(path).detach()


def _bind(path: str) -> socket.socket:
    """Listen at ``path`` (mode 0666: every request is authorized on its own). A stale socket
    left by a dead predecessor is replaced; anything else at the path is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK
                         | socket.SOCK_CLOEXEC)
    old = os.umask(0o111)
    try:
        sock.bind(path)
        sock.listen(1024)  # a flood's connections wait here while the door refuses them
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    return sock
