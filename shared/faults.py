"""Test-only switches that open crash windows timing alone cannot hit. Pure but for the
environment lookup.

Every switch is listed here, once: the code asks ``agent_fault``/``supervisor_fault`` by name
(an unlisted name is a bug and raises; ``crash-before-sync:N`` carries a number and is parsed
by the agent itself), and the table in docs/architecture.md section 13 is
generated from ``FAULTS`` (scripts/doc_tables.py). The agent reads ``TETHER_AGENT_FAULT`` at
start; a supervisor reads ``TETHER_SUPERVISOR_FAULT`` from the environment the agent passes on
(``TETHER_*`` variables; tasks get the submitted ``env`` instead). Both are comma-separated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

AGENT = "TETHER_AGENT_FAULT"
SUPERVISOR = "TETHER_SUPERVISOR_FAULT"


@dataclass(frozen=True)
class Fault:
    variable: str
    name: str
    reader: str
    effect: str


FAULTS = (
    Fault(AGENT, "stall-before-claim", "the agent (`tether agent`)",
          "a supervisor found `ready` is not claimed (unless a cancel was requested), so it "
          "sits until its claim deadline"),
    Fault(AGENT, "skip-ack", "the agent",
          "a result collected through `wait` is recorded but not acknowledged, so the "
          "supervisor lingers. The orphan pass at the next start still acks"),
    Fault(AGENT, "crash-before-sync[:N]", "the agent",
          "at its Nth database sync (default 1) with replies, spawns or requests held behind "
          "it, the agent SIGKILLs itself after those writes' commits and before their fsync: "
          "nothing held has been sent (`tests/integration/test_group_commit.py`)"),
    Fault(AGENT, "hold-lookup", "the agent",
          "the lookup of a job's user at launch (on the worker thread) creates `lookup.held` "
          "in the state directory and waits for `lookup.go` there, as a hung user database "
          "would (the agent must keep answering meanwhile)"),
    Fault(AGENT, "hold-spawn-prep", "the agent",
          "the worker thread that makes each spawn's run directory, that done, creates "
          "`prep.held` in the state directory and goes on once `prep.go` exists there (the "
          "agent must keep serving meanwhile)"),
    Fault(AGENT, "fail-sync", "the agent",
          "the sync thread's first fsync that actions wait for fails (EIO): the agent stops "
          "with an error (crash-only) and sends none of what waited for it"),
    Fault(AGENT, "hold-sync", "the agent",
          "the sync thread (group commit), before each fsync that actions wait for, creates "
          "`sync.held` in the state directory and goes on once `sync.go` exists there (the "
          "loop must keep reading and recording requests meanwhile)"),
    Fault(AGENT, "spawn-fails", "the agent",
          "every supervisor it starts fails to start (SpawnFailed), as on a node whose install "
          "is broken: a cluster's member gives such runs back and drains itself"),
    Fault(AGENT, "no-template", "the agent",
          "no supervisor template: every supervisor starts cold (tests and benchmarks compare "
          "the two)"),
    Fault(AGENT, "no-lstopo", "the agent",
          "hwloc's `lstopo` is taken to be missing, as on a node without hwloc's tools: no "
          "topology XML, and MPI ranks discover the topology themselves"),
    Fault(SUPERVISOR, "die-after-launch", "each supervisor",
          "after starting its tasks, the supervisor SIGKILLs itself before writing the "
          "`running` manifest (row 13b), once the test says go (it creates `launched.go` in "
          "the run directory: until then the tasks are known to have started, not to have run)"),
    Fault(SUPERVISOR, "opener-dies", "each supervisor",
          "the forked output opener (section 10) exits without a word, as if it had been "
          "killed"),
    Fault(SUPERVISOR, "refuse-unshare", "each supervisor",
          "the output opener thread (a job of the supervisor's own user) is refused "
          "`unshare(CLONE_FS)`, as under a container's seccomp policy: the supervisor forks "
          "an opener instead, as for another user's job"),
    Fault(SUPERVISOR, "hold-sweep", "each supervisor",
          "the thread looking for leftover children while the step drains stops after its "
          "scan, creates `sweep.held` in the run directory and goes on once `sweep.go` exists "
          "there (the loop must keep answering meanwhile)"),
    Fault(SUPERVISOR, "hold-scan", "each supervisor",
          "the same for the /proc scan behind `pids` and `stats` (`scan.held`, `scan.go`)"),
    Fault(SUPERVISOR, "proc-scan", "each supervisor",
          "the supervisor finds its leftover children, and the processes `pids` and `stats` "
          "report, by a scan of all of /proc on a thread, as on a kernel without "
          "`/proc/PID/task/TID/children` (`hold-sweep` implies it for the leftovers)"),
    Fault(SUPERVISOR, "hold-after-ready", "each supervisor",
          "once it has sent the ready byte (both sockets listen, the doors not set up yet), the "
          "supervisor creates `ready.held` in the run directory and waits for `ready.go` there: "
          "the agent's connection and hello wait in the kernel's backlog meanwhile"),
    Fault(SUPERVISOR, "hold-after-task", "each supervisor",
          "once the first task is started and before the next, the supervisor creates "
          "`task.held` in the run directory and waits for `task.go` there (each task is "
          "forked on its own CPUs: the supervisor must be back on its own meanwhile)"),
    Fault(SUPERVISOR, "error-on-usr2", "each supervisor",
          "SIGUSR2 raises an exception in the loop that nothing expects: the supervisor kills "
          "its tasks and exits with status 3 (crash-only)"),
    Fault("TETHER_AUDIT_IMPORTS", "1", "each supervisor",
          "an audit hook logs `late import of M after start-up` to `supervisors.log` for any "
          "module imported once start-up is over"),
    Fault("TETHER_SUBUID_FILE", "PATH", "the agent",
          "reads the subordinate uids' ranges (who counts as whom at its door) from PATH "
          "instead of `/etc/subuid` (the same checks: root's, writable by no one else)"),
)

_NAMES = {(f.variable, f.name) for f in FAULTS}


def agent_faults() -> frozenset[str]:
    """The agent's switches, read once at its start."""
    return frozenset(f for f in os.environ.get(AGENT, "").split(",") if f)


def agent_fault(active: frozenset[str], name: str) -> bool:
    if (AGENT, name) not in _NAMES:
        raise KeyError(f"unknown agent fault {name!r}: list it in shared/faults.py")
    return name in active


def supervisor_fault(name: str) -> bool:
    if (SUPERVISOR, name) not in _NAMES:
        raise KeyError(f"unknown supervisor fault {name!r}: list it in shared/faults.py")
    return name in os.environ.get(SUPERVISOR, "").split(",")
