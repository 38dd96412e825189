"""What an agent is configured with (``tether agent``'s options), the host facts its defaults
come from, and the error that stops it.

Apart from daemon.py so that the command line (cli/cmd_agent.py) and the agent's parts
(group_commit.py raises ``AgentError``) share them without importing the loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ClusterConfig:
    """How a node takes part in a cluster (``--cluster-dsn``, ...: cluster.py); here rather
    than there so that the configuration imports no part of the agent."""

    #: the node's own connection string (its role and password): never logged, never shown
    dsn: str = field(repr=False)
    #: seconds between heartbeats
    heartbeat: float = 2.0
    #: a login node: serves its users' requests and the cluster, owns no resources
    login: bool = False


@dataclass
class ServiceConfig:
    """How the agent behaves as a service: its template's end, its metrics (``reload.py``,
    ``metrics.py``). A part of ``AgentConfig`` of its own, so that what a site's monitoring
    and init system need reads as one thing."""

    #: SIGTERM and SIGINT end the supervisor template too (``--stop-for-good``)
    stop_for_good: bool = False
    #: how long the template stays once no agent runs (``--template-linger``)
    template_linger: float = 300.0
    #: the Prometheus textfile (``--metrics-file``), and how often it is written
    metrics_file: str | None = None
    metrics_interval: float = 15.0


@dataclass
class UserLimits:
    """What one user may hold of the node (issue 27): Slurm's MaxSubmitJobs and MaxJobs, the
    fair-share decay, and how long and how many of her ended jobs the jobs table keeps."""

    #: pending jobs per user, array elements each counted (``--max-queued-per-user``; 0: none)
    max_queued: int = 1000
    #: jobs holding resources per user (``--max-running-per-user``; 0: none)
    max_running: int = 1000
    #: MiB of the state directory one user's job records may take (``--max-user-records-mb``)
    max_records_mb: int = 64
    #: the half-life of the usage fair share orders by, seconds (``--fairshare-half-life``)
    half_life: float = 7 * 86400.0
    #: ended jobs stay in the jobs table this long (``--keep-ended``, days) ...
    keep_ended_days: float = 7.0
    #: ... and at most this many of each user's (``--keep-ended-count``)
    keep_ended_count: int = 1000


@dataclass
class AgentConfig:
    state_dir: str
    cpu_ids: list[int]
    gpus: int
    memory_mb: int
    node: str
    cancel_grace: float = 10.0
    #: time limits (seconds): given to a job submitted without one; the most a job may ask for
    default_time: float | None = None
    max_time: float | None = None
    claim_timeout: float = 120.0
    linger: float = 3600.0
    faults: frozenset[str] = field(default_factory=frozenset)
    cluster: ClusterConfig | None = None
    #: auto, v2, v1 or none (shared/cgroup_host.py)
    cgroup: str = "auto"
    cgroup_base: str | None = None  #: None: contain.default_base(state_dir)
    default_memory_mb: int = 0
    #: warm supervisors mark their own pages for kernel same-page merging (``--ksm``)
    ksm: bool = False
    #: whose tasks load the node's topology from hwloc XML: pmi, all or off (topology.py)
    hwloc_xml: str = "pmi"
    #: seconds a submission's check run as its user may take (checks.py)
    submit_check_timeout: float = 5.0
    #: MiB a step's PMI key-value store may hold (supervisor/pmi_kvs.py)
    pmi_store_mb: int = 16
    #: the template's end, the metrics (above)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    #: per-user limits, fair share, retention (above)
    limits: UserLimits = field(default_factory=UserLimits)


class AgentError(Exception):
    """The agent cannot go on (its state directory is refused or taken, its database cannot be
    made durable): it stops with this one-line reason."""


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 0

