"""A running supervisor re-executing itself into the installed tether (``upgrade``) (I/O).

What must survive ``exec`` and how:
- the pid, the children (the tasks, the adopted daemons) and the session: ``exec`` keeps them;
- the run directory's lock: the locked fd is kept open (its CLOEXEC flag cleared), so the lock is
  never released, not even for an instant;
- the sockets: the agent's ROUTER in ctl/ (ctl.py, through libzmq's ``ZMQ_USE_FD``) and
  everyone's door at ``sock`` accept on listening AF_UNIX sockets the supervisor created itself
  and keeps for its life (each works on a copy of the fd). Before ``exec`` both are closed (the
  ROUTER delivers what it was sent, 1 s at most, and its context ends; a door writes every reply
  as it is sent); connections not yet accepted wait in the listening sockets' backlogs and the
  new process accepts them. An image of 0.5 or 0.6 serves the ctl socket with a door (ZMTP for
  the agent's DEALER) instead: the same listening socket, the same DEALER, so both ways of an
  upgrade work.
  Clients with an established connection see it close and reconnect
  (every tether client does, on a flat 10 ms interval); a request they sent into the closing
  connection is lost and times out, so everything parked (the agent's ``wait``, ``output`` and
  ``events`` followers) is answered first with ``upgrading: true``, and tether's clients ask again
  on a fresh connection a moment later: nothing is lost or repeated, because every follower
  resumes from its own offsets;
- the output reader fds and each PMI rank's socketpair end: kept open, numbers in the state;
- everything else (the step machine's state, the step and its tasks, events, the exit record,
  the PMI server's state, timer deadlines on CLOCK_MONOTONIC, which exec does not reset) goes as
  one versioned dict of plain data, msgpack-encoded after a magic line, in a memfd
  (handover_state.py turns the objects into that data and back).

Format 3 (after 0.6.0) is that dict; formats 1 and 2 (up to 0.6.0) were a pickle of the objects
themselves, which this build still reads (``read_state``: the pickled classes are still found
under their names), so a supervisor of the previous release upgrades into this one. ``FORMAT``
is bumped by a change an older reader would misread (a field it cannot default); before it
executes anything the supervisor asks the installed build which formats it reads
(``--handover-formats``, which also proves that build starts at all) and refuses the upgrade
otherwise, staying as it is.

Signals: the terminating signals and SIGCHLD are blocked across ``exec`` (the mask survives it;
their handlers do not), and the new process unblocks them only after installing its own, so a
SIGTERM in the window is handled, not fatal; a child that ended meanwhile is reaped at resume.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import msgpack

import tether
from tether.supervisor import handover_state

if TYPE_CHECKING:
    from tether.supervisor.state import SupervisorState

#: the layout of the handed-over state; see the module docstring
#: 2: the door's listening socket (``door_fd``) beside the ROUTER's, which listens in ctl/; a
#: format-1 image (no door: its ROUTER on ``sock``, open to everyone) keeps that layout
#: 3: plain data in msgpack (handover_state.py), the machine's state with it, not a pickle
FORMAT = 3
FORMATS_READ = frozenset({1, 2, 3})
#: what a format-3 state begins with (a pickle begins with 0x80)
MAGIC = b"tether-handover\n"
BACKLOG = 128
PROBE_TIMEOUT = 20.0


class HandoverError(Exception):
    pass


def listen(path: str) -> int:
    """A listening AF_UNIX socket on ``path``: the fd the supervisor keeps for its life."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(path)
        s.listen(BACKLOG)
    except BaseException:
        s.close()
        raise
    return s.detach()


def probe_installed() -> str:
    """Ask the installed build (as the re-exec would start it) which formats it reads."""
    try:
        res = subprocess.run([sys.executable, "-I", "-m", "tether.supervisor",
                              "--handover-formats"], capture_output=True, text=True,
                             timeout=PROBE_TIMEOUT, stdin=subprocess.DEVNULL, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HandoverError(f"the installed tether did not start: {exc}") from None
    words = res.stdout.split()
    if res.returncode != 0 or len(words) < 2 or words[0] != "formats":
        raise HandoverError("the installed tether cannot take over a running supervisor "
                            f"(it answered {res.returncode}: "
                            f"{(res.stderr or res.stdout).strip()[-200:]!r})")
    if str(FORMAT) not in words[1].split(","):
        raise HandoverError(f"the installed tether ({words[2] if len(words) > 2 else '?'}) reads "
                            f"handover formats {words[1]}, not {FORMAT}")
    return words[2] if len(words) > 2 else "?"


def capture(sup: SupervisorState) -> dict[str, Any]:
    """The state to hand over, as plain data (format 3)."""
    timers = {name: t.when for name, t in sup.machine_timers.items()
              if name in ("claim", "kill", "limit") and not t.cancelled}
    pmi = None
    if sup.pmi is not None and sup.channels is not None:
        pmi = {"server": handover_state.pmi_to_dict(sup.pmi),
               "ours": {rank: s.fileno() for rank, s in sup.channels.ours.items()},
               "pending": {rank: bytes(b) for rank, b in sup.channels.pending.items()}}
    return {
        "format": FORMAT, "from": tether.__version__, "generation": sup.generation + 1,
        "machine": handover_state.machine_to_dict(sup.machine),
        "step": handover_state.step_to_dict(sup.step),
        "events": sup.events, "record": sup.record, "final_sizes": sup.final_sizes,
        "task_end_boottime": sup.task_end_boottime, "readers": dict(sup.launcher.readers),
        "listen_fd": sup.listen_fd, "door_fd": sup.door_fd, "timers": timers, "pmi": pmi,
    }


def kept_fds(state: dict[str, Any], lock_fd: int) -> list[int]:
    fds = [lock_fd, state["listen_fd"], *state["readers"].values()]
    if state.get("door_fd", -1) >= 0:
        fds.append(state["door_fd"])
    if state["pmi"] is not None:
        fds.extend(state["pmi"]["ours"].values())
    return sorted(set(fds))


def write_state(state: dict[str, Any]) -> int:
    """The state in an inheritable memfd, positioned at its start."""
    fd = os.memfd_create("tether-handover", 0)
    data = MAGIC + msgpack.packb(state, use_bin_type=True)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def read_state(fd: int) -> dict[str, Any]:
    """The state the previous image left in ``fd`` (closed here), with its step (``step``), its
    PMI server (``pmi.server``) and its machine (``machine``, None before format 3) as objects.
    Only our own process can have written it: the fd number came on our command line from our
    own ``exec``."""
    chunks = []
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(1 << 20):
            chunks.append(chunk)
    return decode(b"".join(chunks))


def decode(data: bytes) -> dict[str, Any]:
    """A handed-over state of any format this build reads (``read_state``)."""
    if data.startswith(MAGIC):
        state = msgpack.unpackb(data[len(MAGIC):], raw=False, strict_map_key=False)
    else:  # formats 1 and 2, up to 0.6.0: a pickle of the objects
        state = pickle.loads(data)  # noqa: S301 (written by this very process)
    if not isinstance(state, dict) or state.get("format") not in FORMATS_READ:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise HandoverError(f"handover state of unknown format {got!r}")
    if state["format"] < 3:
        state["machine"] = None
        return state
    state["step"] = handover_state.step_from_dict(state["step"])
    state["machine"] = handover_state.machine_from_dict(state["machine"])
    if state["pmi"] is not None:
        state["pmi"]["server"] = handover_state.pmi_from_dict(state["pmi"]["server"])
    return state


def argv(sup: SupervisorState, state_fd: int) -> list[str]:
    return [sys.executable, "-I", "-m", "tether.supervisor", "--run-dir", sup.rd.path,
            "--lock-fd", str(sup.lock_fd), "--resume-fd", str(state_fd)]
