"""The PMI server's I/O: one socketpair per rank, driven by the supervisor's loop (I/O).

Each rank gets its own end as ``PMI_FD`` (and nothing else: pass_fds hands a child exactly its
own fd; our ends are close-on-exec). Our ends are non-blocking; replies that do not fit in the
socket buffer wait in a per-rank queue until the loop reports the fd writable, so a rank that
stops reading can never stall the supervisor. EOF only means this fd is done: a rank's children
inherit PMI_FD, and deaths are learned from the reaper, never from EOF.
"""

from __future__ import annotations

import logging
import socket

from tether.supervisor.pmi import Output, PmiServer, Send

log = logging.getLogger("tether.supervisor")

#: PMI_* variables from the submitter's environment (an outer Slurm or Hydra) would point the
#: client at someone else's server or make it a singleton: they are removed from every rank.
INHERITED_PREFIX = "PMI_"


class PmiChannels:
    def __init__(self, server: PmiServer) -> None:
        self.server = server
        self.ours: dict[int, socket.socket] = {}  # rank -> our end
        self.theirs: dict[int, socket.socket] = {}  # rank -> the rank's end, until spawned
        self.pending: dict[int, bytearray] = {}

    def prepare(self, rank: int) -> tuple[dict[str, str], tuple[int, ...]]:
        """The environment additions and the fd to pass for ``rank``'s launch."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        self.ours[rank] = ours
        self.theirs[rank] = theirs
        fd = theirs.fileno()
        env = {"PMI_FD": str(fd), "PMI_RANK": str(rank), "PMI_SIZE": str(self.server.size),
               "PMI_JOBID": self.server.jobid}
        return env, (fd,)

    def spawned(self, rank: int) -> None:
        """The rank holds its end now (or never will): close our copy of it."""
        theirs = self.theirs.pop(rank, None)
        if theirs is not None:
            theirs.close()

    def fd_ranks(self) -> dict[int, int]:
        return {sock.fileno(): rank for rank, sock in self.ours.items()}

    def readable(self, rank: int) -> list[Output]:
        sock = self.ours.get(rank)
        if sock is None:
            return []
        out: list[Output] = []
        while True:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                break
            except OSError as exc:
                log.info("rank %d: PMI connection error: %s", rank, exc)
                self.close(rank)
                break
            if not data:
                self.close(rank)
                break
            out.extend(self.server.feed(rank, data))
        return out

    def send(self, msg: Send) -> None:
        if msg.rank not in self.ours:
            return  # its connection is gone; the rank cannot read the reply anyway
        self.pending.setdefault(msg.rank, bytearray()).extend(msg.data)
        self.flush(msg.rank)

    def flush(self, rank: int) -> None:
        buf = self.pending.get(rank)
        sock = self.ours.get(rank)
        if not buf or sock is None:
            return
        try:
            sent = sock.send(buf)
        except BlockingIOError:
            return
        except OSError as exc:
            log.info("rank %d: cannot write to PMI connection: %s", rank, exc)
            self.close(rank)
            return
        del buf[:sent]

    def wants_write(self) -> set[int]:
        return {rank for rank, buf in self.pending.items() if buf and rank in self.ours}

    def close(self, rank: int) -> None:
        sock = self.ours.pop(rank, None)
        if sock is not None:
            sock.close()
        self.pending.pop(rank, None)

    def close_all(self) -> None:
        for rank in list(self.ours):
            self.close(rank)
        for rank in list(self.theirs):
            self.spawned(rank)


def clean_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(INHERITED_PREFIX)}

