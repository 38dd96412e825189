"""The node's topology as hwloc XML, gathered once per agent start for MPI ranks to load (I/O).

Every MPICH rank loads the node's hwloc topology in ``MPI_Init``; so do Open MPI's ranks and
hydra's proxy. On this machine that discovery (sysfs, and PCI configuration space) is a quarter
of a 2-rank hello's CPU: ~20 ms of a 60 ms ``mpiexec -n 2`` run. Flux's job shell offers the
cure as its ``hwloc.xmlfile`` option, and so does this module: ``lstopo`` runs once when the
agent starts, its XML is kept at ``<state_dir>/topology.xml``, and each task of a step with PMI
(``--hwloc-xml all``: of every step) is started with

    HWLOC_XMLFILE=<that file>                  load this instead of discovering
    HWLOC_THISSYSTEM=1                         it is this machine: binding still binds
    HWLOC_THISSYSTEM_ALLOWED_RESOURCES=1       the CPUs and memory the task may use are read
                                               from its own cgroup, not from the file

unless the job's environment names an ``HWLOC_XMLFILE`` of its own.

Who gathers it: ``lstopo`` is run from /usr/bin by absolute path, never through a PATH, with an
empty environment, and, when the agent is root, as ``nobody``: hwloc reads the machine's DMI
serial numbers where only root may, and the file is for every user to read (0644). What any
user's own rank would have discovered is what the file holds.

It is gathered afresh at every start (CPUs and devices change across reboots) on the agent's
own thread, so the agent serves without waiting for it; steps launched before it is ready
discover the topology themselves, as they do when hwloc's tools are not installed (said once).
The file is replaced by a rename, so a rank loading it reads a whole one, old or new; it needs
no fsync: a crash before the data reach the disk is followed by a start that writes it again
before offering it.
"""

from __future__ import annotations

import logging
import os
import pwd
import subprocess
import time
from typing import Any

log = logging.getLogger("tether.agent")

#: where Debian's hwloc-nox puts it (``lstopo`` is the graphical build's name for the same tool)
LSTOPO = ("/usr/bin/lstopo-no-graphics", "/usr/bin/lstopo")
#: ``--hwloc-xml``: steps with PMI (the default), every step, none
MODES = ("pmi", "all", "off")
#: a big node's XML is a few hundred KiB; anything past this is not a topology
MAX_BYTES = 64 << 20
#: hwloc answers in ~20 ms here; a hung sysfs read must not hold the worker thread for long
DEADLINE = 30.0
ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}
NOT_INSTALLED = f"{LSTOPO[0]} is not installed (Debian: hwloc-nox)"


class TopologyError(Exception):
    pass


def lstopo() -> str | None:
    for path in LSTOPO:
        if os.access(path, os.X_OK):
            return path
    return None


def _unprivileged() -> dict[str, Any]:
    """subprocess's arguments to run as ``nobody`` when we are root (else as ourselves)."""
    if os.geteuid() != 0:
        return {}
    try:
        pw = pwd.getpwnam("nobody")
        uid, gid = pw.pw_uid, pw.pw_gid
    except KeyError:
        uid = gid = 65534
    return {"user": uid, "group": gid, "extra_groups": []}


def gather(path: str) -> float:
    """Run lstopo and keep its XML at ``path``; the milliseconds it took."""
    t0 = time.monotonic()
    exe = lstopo()
    if exe is None:
        raise TopologyError(NOT_INSTALLED)
    try:
        res = subprocess.run([exe, "--of", "xml", "-"], stdin=subprocess.DEVNULL,
                             capture_output=True, env=ENV, cwd="/", timeout=DEADLINE,
                             **_unprivileged())
    except subprocess.TimeoutExpired:
        raise TopologyError(f"{exe} gave no topology within {DEADLINE:.0f} s") from None
    except OSError as exc:
        raise TopologyError(f"cannot run {exe}: {exc.strerror}") from None
    xml: bytes = res.stdout
    if res.returncode != 0:
        why = res.stderr.decode(errors="replace").strip().splitlines()
        raise TopologyError(f"{exe} exited {res.returncode}: {why[-1] if why else 'no message'}")
    if len(xml) > MAX_BYTES or not xml.startswith(b"<?xml") or b"<topology" not in xml[:4096]:
        raise TopologyError(f"{exe} printed something that is not an hwloc topology")
    tmp = path + ".new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        os.fchmod(fd, 0o644)  # whatever the umask: every user's ranks read it
        view = memoryview(xml)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.rename(tmp, path)
    return (time.monotonic() - t0) * 1000


class Topology:
    """The agent's side: gathers the XML once, then names it in the specs that want it."""

    def __init__(self, path: str, mode: str, *, missing: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown --hwloc-xml mode {mode!r}")
        self.path = path
        self.mode = mode
        self.missing = missing  #: fault ``no-lstopo``
        #: the file, once this start's lstopo has written it
        self.ready: str | None = None

    def gather(self) -> float:
        if self.missing:
            raise TopologyError(NOT_INSTALLED)
        return gather(self.path)

    def gathered(self, ms: float | None, exc: BaseException | None) -> None:
        """On the loop, when the worker thread is done."""
        if exc is not None:
            log.warning("no hwloc topology for MPI ranks (%s): each rank discovers it itself, "
                        "~10 ms of CPU more each", exc)
            return
        self.ready = self.path
        log.info("hwloc topology for %s kept in %s (%.0f ms)",
                 "steps with PMI" if self.mode == "pmi" else "every step", self.path, ms or 0.0)

    def for_step(self, pmi: str) -> str | None:
        """The XML a step's tasks load, or None (not ready, not wanted, or off). ``pmi`` is
        the job's: none, pmi1 or pmi2."""
        if self.ready is None or self.mode == "off":
            return None
        return self.ready if self.mode == "all" or pmi != "none" else None
