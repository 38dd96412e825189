"""The agent's side of the steps' cgroups (I/O): the probe at start, the base directories, each
step's plan (in its spec), and the clean-up of cgroups whose supervisor is gone.

The supervisor owns its step's cgroup while it lives: it creates it before the first fork,
kills it at the step's end and removes it once the exit record is written. The agent touches a
step's cgroup only when no supervisor holds the run directory's lock (a lost step: everything in
it is killed; an orphan left by a crash: removed), or to freeze and thaw it (suspend, resume).
The directories are computed from this agent's settings, never read from a file.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from typing import Any

from tether.shared import cgroup_host, cgroup_layout, step_cgroup
from tether.shared.cgroup_layout import UNIFIED, Host
from tether.shared.step_cgroup import CgroupError, StepCgroup

log = logging.getLogger("tether.agent")


class BadBase(ValueError):
    pass


def default_base(state_dir: str) -> str:
    """``tether-`` and a hash of the state directory: agents of different state directories on
    one host (tests, a second agent) never share a base, so one never takes another's steps'
    cgroups for orphans."""
    return "tether-" + hashlib.sha256(state_dir.encode()).hexdigest()[:8]


def remove_all(base: str) -> list[str]:
    """Kill everything in the steps' cgroups under ``base`` (an agent's ``--cgroup-base``) in
    every hierarchy, and remove them with the base: what tests, benchmarks and the demo do after
    their agents (a running agent cleans its own steps; root only, else nothing to do). Returns
    the directories still there (each was tried for a while: step_cgroup.remove_tree)."""
    if os.geteuid() != 0:
        return []
    left = []
    for mode in ("v1", "v2"):
        for path in cgroup_layout.base_dirs(cgroup_host.probe(mode), base).values():
            if not step_cgroup.remove_tree(path):
                left.append(path)
    return left


def check_base(base: str) -> str:
    parts = [p for p in base.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise BadBase(f"--cgroup-base {base!r} must name a directory below the agent's own "
                      "cgroup (or an absolute one), without '.' or '..'")
    return ("/" if base.startswith("/") else "") + "/".join(parts)


class Containment:
    def __init__(self, want: str, base: str | None, default_memory_mb: int,
                 state_dir: str = "") -> None:
        base = base or default_base(state_dir)
        self.want = want
        self.base = check_base(base)
        self.default_memory_mb = default_memory_mb
        self.host = Host("none", note="not probed yet")
        self.bases: dict[str, str] = {}

    def start(self) -> None:
        """Probe (once) and create the base directories; said once in the log, never fatal."""
        self.host = cgroup_host.probe(self.want)
        if self.host.mode != "none":
            bases = cgroup_layout.base_dirs(self.host, self.base)
            try:
                for path in bases.values():
                    os.makedirs(path, 0o755, exist_ok=True)
                if self.host.mode == "v2" and self.host.memory:
                    try:
                        cgroup_host.enable_v2_controllers(self.host.own[UNIFIED],
                                                          bases[UNIFIED])
                    except OSError as exc:
                        self.host.memory = False
                        self.host.note = (f"cannot enable the memory controller for the "
                                          f"steps ({exc}): memory is not enforced")
                self.bases = bases
            except OSError as exc:
                self.host = Host("none", available=self.host.available,
                                 note=f"cannot create the cgroup base: {exc}")
        if self.host.mode == "none":
            log.warning("cgroups: none (%s); steps are tracked by process group and session, "
                        "memory is counted, not enforced, and suspend is not available",
                        self.host.note)
        else:
            log.info("cgroups: %s, steps under %s%s", self.host.mode,
                     ", ".join(sorted(self.bases.values())),
                     f" ({self.host.note})" if self.host.note else "")

    def stop(self) -> None:
        """The agent is going: remove its base directories if no step is left in them (a busy
        agent's stay for its steps and its next start). Never raises."""
        for path in self.bases.values():
            with contextlib.suppress(OSError):
                os.rmdir(path)

    @property
    def mode(self) -> str:
        return self.host.mode

    def status(self) -> dict[str, Any]:
        out = self.host.to_dict()
        out["base"] = dict(self.bases)
        out["default_memory_mb"] = self.default_memory_mb
        return out

    def plan(self, job: int, attempt: int, memory_mb: int) -> dict[str, Any]:
        """The ``cgroup`` section of a step's spec."""
        return cgroup_layout.step_plan(self.host.mode, self.bases, job, attempt,
                                       memory_mb or self.default_memory_mb, self.host.memory,
                                       self.host.roots)

    def of(self, job: int, attempt: int) -> StepCgroup:
        return StepCgroup(self.plan(job, attempt, 0))

    def populated(self, job: int, attempt: int) -> bool:
        cg = self.of(job, attempt)
        return cg.active and not cg.empty()

    def clean(self, job: int, attempt: int) -> None:
        """A step whose supervisor is gone: kill whatever is left in its cgroup, remove it."""
        cg = self.of(job, attempt)
        if not cg.active or not cg.exists():
            return
        pids = cg.procs()
        if not cg.kill_and_wait():
            log.error("job %d: processes %s are still in the cgroup of its step %d after "
                      "SIGKILL", job, sorted(cg.procs()), attempt)
        elif pids:
            log.warning("job %d: killed %d leftover process(es) in the cgroup of its step %d",
                        job, len(pids), attempt)
        if not cg.remove():
            log.error("job %d: cannot remove the cgroup of step %d: %s", job, attempt, cg.dirs)

    def steps_present(self) -> set[tuple[int, int]]:
        """(job, attempt) of every step cgroup under the bases."""
        found = set()
        for base in self.bases.values():
            try:
                names = os.listdir(base)
            except OSError:
                continue
            for name in names:
                job, dot, attempt = name.partition(".")
                if dot and job.isdigit() and attempt.isdigit() and os.path.isdir(
                        os.path.join(base, name)):
                    found.add((int(job), int(attempt)))
        return found

    def freeze(self, job: int, attempt: int) -> None:
        cg = self.of(job, attempt)
        if not cg.active:
            raise CgroupError(f"this node cannot suspend jobs (cgroups: {self.host.mode})")
        # before the freezer is looked for: a step whose tasks just ended has no cgroup (its
        # supervisor removed it), and so no freezer file either, on any node
        if not cg.exists():
            raise CgroupError(f"job {job} has no cgroup (it ended, or started before cgroups "
                              "were on)")
        if not cg.can_freeze:
            raise CgroupError(f"this node cannot suspend jobs (cgroups: {self.host.mode}, "
                              "no freezer)")
        if not cg.freeze():
            log.warning("job %d: the freeze has not settled yet", job)

    def thaw(self, job: int, attempt: int) -> None:
        cg = self.of(job, attempt)
        if cg.active and cg.exists():
            cg.thaw()

    def stats(self, job: int, attempt: int) -> dict[str, Any] | None:
        cg = self.of(job, attempt)
        if not cg.active or not cg.exists():
            return None
        return cg.stats()
