"""The host's cgroups (I/O), as the agent finds and prepares them once at start: ``probe`` reads
this process's view of the host and chooses a mode (``cgroup_layout.choose``), and
``enable_v2_controllers`` hands memory and pids to the agent's base on a pure v2 host. Apart
from ``shared/step_cgroup.py`` (one step's cgroup): a supervisor needs that one alone.
"""

from __future__ import annotations

import contextlib
import errno
import os

from tether.shared.cgroup_layout import (
    LEAF,
    UNIFIED,
    Host,
    choose,
    parse_mountinfo,
    parse_proc_cgroup,
)
from tether.shared.cgroup_layout import join as _join
from tether.shared.step_cgroup import procs_of, write


def probe(want: str = "auto") -> Host:
    """Read this process's view of the host (I/O) and choose."""
    if want == "none":
        return Host("none", note="cgroups turned off")
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = parse_mountinfo(f.read())
        with open("/proc/self/cgroup") as f:
            own = parse_proc_cgroup(f.read())
    except OSError as exc:
        return Host("none", note=f"cannot read the cgroup layout: {exc}")
    controllers: set[str] = set()
    v2 = next((m for m in mounts if m.fstype == "cgroup2"), None)
    if v2 is not None:
        path = os.path.join(_join(v2.point, own.get(UNIFIED, "/")), "cgroup.controllers")
        with contextlib.suppress(OSError), open(path) as f:
            controllers = set(f.read().split())
    return choose(mounts, own, controllers, want)


def enable_v2_controllers(own: str, base: str) -> None:
    """Give ``base`` (below ``own``) and the steps' cgroups in it memory and pids controllers.

    cgroup2's "no internal processes" rule: a cgroup that holds processes cannot hand
    controllers to its children, so when ``own`` refuses (EBUSY) every process in it (the agent,
    supervisors of an earlier agent) moves to ``own/tether-leaf`` first; the probe reads that
    leaf as ``own`` again. Raises OSError."""
    with open(os.path.join(own, "cgroup.controllers")) as f:
        have = set(f.read().split())
    want = " ".join(f"+{c}" for c in ("memory", "pids") if c in have)
    if not want:
        return
    try:
        write(os.path.join(own, "cgroup.subtree_control"), want)
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        leaf = os.path.join(own, LEAF)
        with contextlib.suppress(FileExistsError):
            os.mkdir(leaf, 0o755)
        for pid in procs_of(own):
            with contextlib.suppress(ProcessLookupError):
                write(os.path.join(leaf, "cgroup.procs"), str(pid))
        write(os.path.join(own, "cgroup.subtree_control"), want)
    rel = os.path.relpath(base, own)
    if rel.startswith(".."):  # an absolute base elsewhere: its own ancestors are the operator's
        write(os.path.join(base, "cgroup.subtree_control"), want)
        return
    path = own
    for part in rel.split("/"):
        path = os.path.join(path, part)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o755)
        write(os.path.join(path, "cgroup.subtree_control"), want)
