"""Which cgroups a host has and where a step's go: the pure part of the cgroup code
(``shared/cgroup_host.py`` probes the host, ``shared/step_cgroup.py`` works a step's cgroup).

Modes (chosen by ``choose`` from what ``cgroup_host.probe`` read):

- ``v2``: a cgroup2 mount. Tracking, ``cgroup.kill``, ``cgroup.freeze`` and ``cgroup.events``
  need no controller; memory is enforced only where the ``memory`` controller can be enabled.
  Chosen by ``auto`` when that mount offers the memory controller (a pure v2 host).
- ``hybrid``: v1 memory for the limit, and the cgroup2 mount (even without controllers) for
  tracking, kill, freeze and CPU time. Chosen by ``auto`` when v2 has no memory controller but
  v1 has, and a cgroup2 mount exists (this host: cgroup2 at /sys/fs/cgroup/unified with no
  controllers, v1 memory nested under the machine's own accounting cgroup). Two hierarchies,
  not four: each costs the supervisor two writes to ``cgroup.procs`` per task (the first write
  of a burst waits for an RCU grace period, the rest are cheap), and each is one more
  directory to make, kill and remove.
- ``v1``: the v1 hierarchies that exist among memory, pids, freezer and cpuacct, one directory
  in each (kill by freezing). Chosen by ``auto`` when there is no cgroup2 mount.
- ``none``: neither; steps are tracked by process group and session as before.

Each step gets one directory per hierarchy, ``<own cgroup>/<base>/<job>.<attempt>`` (``base``
absolute: from the hierarchy's root); ``step_plan`` is what travels in the spec.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

MODES = ("v2", "hybrid", "v1", "none")
#: the v1 hierarchies a step uses (cpuset is probed and reported, never used: affinity is set
#: on each task already, and a cpuset cgroup needs cpus and mems filled in before use)
V1_KINDS = ("memory", "pids", "freezer", "cpuacct")
UNIFIED = "unified"
#: cgroup2 forbids processes in a cgroup whose children have controllers: the agent (and the
#: supervisors it starts after) move to this leaf of their own cgroup to enable them
LEAF = "tether-leaf"


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str  #: "cgroup" (v1) or "cgroup2"
    controllers: frozenset[str]  #: v1: from the super options; v2: empty (see cgroup.controllers)


def parse_mountinfo(text: str) -> list[Mount]:
    """The cgroup mounts in a ``/proc/PID/mountinfo``. Pure."""
    mounts = []
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        if not sep:
            continue
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        point = fields[4].replace("\\040", " ")
        opts = set(tail[2].split(",")) if tail[0] == "cgroup" else set()
        mounts.append(Mount(point, tail[0], frozenset(opts)))
    return mounts


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/PID/cgroup`` as {hierarchy kind: path}; the cgroup2 line is ``unified``. Pure."""
    own: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, names, path = parts
        if names == "":
            own[UNIFIED] = path
        for name in names.split(","):
            if name:
                own[name] = path
    return own


@dataclass
class Host:
    """What the probe found, and the mode chosen. JSON-able through ``to_dict``."""

    mode: str
    #: kind -> the directory of this process's own cgroup in that hierarchy
    own: dict[str, str] = field(default_factory=dict)
    #: kind -> the hierarchy's mount point
    roots: dict[str, str] = field(default_factory=dict)
    #: kinds that exist but are not used by the mode (reported)
    available: list[str] = field(default_factory=list)
    #: memory limits can be enforced
    memory: bool = False
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "memory_enforced": self.memory,
                "hierarchies": sorted(self.own), "available": self.available,
                "note": self.note}


def choose(mounts: list[Mount], own_paths: dict[str, str], v2_controllers: set[str],
           want: str = "auto") -> Host:
    """Pick the mode from what the probe read. Pure: ``v2_controllers`` is the cgroup2 mount's
    ``cgroup.controllers`` at the agent's own cgroup (what its children could get)."""
    v2 = next((m for m in mounts if m.fstype == "cgroup2"), None)
    v1: dict[str, str] = {}
    roots: dict[str, str] = {}
    for kind in (*V1_KINDS, "cpuset"):
        m = next((m for m in mounts if m.fstype == "cgroup" and kind in m.controllers), None)
        if m is not None and kind in own_paths:
            v1[kind] = join(m.point, own_paths[kind])
            roots[kind] = m.point
    if v2 is not None:
        roots[UNIFIED] = v2.point
    v2_own = own_paths.get(UNIFIED, "/")
    if os.path.basename(v2_own) == LEAF:  # moved there by ``enable_v2_controllers``
        v2_own = os.path.dirname(v2_own)
    v2_dir = join(v2.point, v2_own) if v2 is not None else None
    available = sorted([*v1, *([UNIFIED] if v2_dir else [])])
    if want == "auto":
        if v2_dir and "memory" in v2_controllers:
            want = "v2"
        elif v2_dir and "memory" in v1:
            want = "hybrid"
        elif any(k in v1 for k in ("memory", "freezer")):
            want = "v1"
        elif v2_dir:
            want = "v2"
        else:
            want = "none"
    if want == "v2":
        if not v2_dir:
            return Host("none", available=available, note="no cgroup2 mount")
        mem = "memory" in v2_controllers
        return Host("v2", {UNIFIED: v2_dir}, {UNIFIED: roots[UNIFIED]}, available, mem,
                    "" if mem else "no memory controller in cgroup2: memory is not enforced")
    if want == "hybrid":
        if not v2_dir or "memory" not in v1:
            return Host("none", available=available,
                        note="hybrid needs a cgroup2 mount and a v1 memory hierarchy")
        return Host("hybrid", {"memory": v1["memory"], UNIFIED: v2_dir},
                    {"memory": roots["memory"], UNIFIED: roots[UNIFIED]}, available, True)
    if want == "v1":
        used = {k: v for k, v in v1.items() if k in V1_KINDS}
        if not used:
            return Host("none", available=available, note="no cgroup v1 hierarchy to use")
        mem = "memory" in used
        return Host("v1", used, {k: roots[k] for k in used}, available, mem,
                    "" if mem else "no v1 memory hierarchy: memory is not enforced")
    return Host("none", available=available, note="cgroups not used")


def join(root: str, path: str) -> str:
    return os.path.normpath(os.path.join(root, path.lstrip("/")))


def base_dirs(host: Host, base: str) -> dict[str, str]:
    """kind -> the directory under which steps' cgroups go (``base`` relative to the agent's
    own cgroup, or absolute from each hierarchy's root)."""
    return {kind: join(host.roots[kind] if base.startswith("/") else own, base)
            for kind, own in host.own.items()}


def step_name(job: int, attempt: int) -> str:
    return f"{job}.{attempt}"


def step_plan(mode: str, bases: dict[str, str], job: int, attempt: int, memory_mb: int,
              memory: bool, roots: dict[str, str] | None = None) -> dict[str, Any]:
    """What the supervisor needs, in the spec. ``memory_mb`` 0 is unlimited but accounted.
    ``roots``: each hierarchy's mount point, so that the supervisor finds its own cgroup's
    directory without reading the mount table."""
    if mode == "none" or not bases:
        return {"mode": "none"}
    name = step_name(job, attempt)
    plan: dict[str, Any] = {
        "mode": mode, "dirs": {k: os.path.join(v, name) for k, v in sorted(bases.items())},
        "memory_mb": memory_mb if memory else 0}
    if roots:
        plan["roots"] = {k: roots[k] for k in sorted(bases) if k in roots}
    return plan
