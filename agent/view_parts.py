"""The parts of the agent that other parts reach through it, as those see them.

The scheduler, the cluster node, ... are the agent's attributes; a part that uses one through
the agent (``agent.scheduler.started(job)``) types it with a protocol here rather than with
its class, whose module imports view.py: no import cycle (see view.py). daemon.py has mypy
check that the agent's real ones are these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tether.agent.cluster_db import NodeInfo
    from tether.agent.db import Store
    from tether.agent.job import Job
    from tether.shared import protocol
    from tether.shared.door_conn import Conn


class SchedulerPart(Protocol):
    """scheduler.py's ``Scheduler``, as effects.py, launcher.py and recovery.py use it."""

    def launched(self, job_id: int, started_at: str) -> None: ...
    def released(self, job_id: int) -> None: ...
    def started(self, job: Job) -> None: ...
    def running(self, job: Job) -> None: ...


class ClusterPart(Protocol):
    """cluster.py's ``ClusterNode``, as the node's own parts use it."""

    @property
    def info(self) -> NodeInfo: ...
    @property
    def state(self) -> str: ...
    def job_ended(self, job: Job) -> None: ...
    def job_running(self, job: Job) -> None: ...
    def fence_spec(self, local_job: int) -> dict[str, Any] | None: ...


class ClusterRequestsPart(Protocol):
    """cluster_api.py's ``ClusterRequests``, as api.py and cluster.py use it."""

    @property
    def kinds(self) -> frozenset[str]: ...
    def dispatch(self, peer: Conn, req: protocol.Request) -> Any: ...
    def job_changed(self, job: int) -> None: ...


class PersonsPart(Protocol):
    """persons.py's ``Persons``, as api.py uses it."""

    def status(self) -> dict[str, Any]: ...


class PurgePart(Protocol):
    """retention.py's ``Purge``, as answering.py uses it."""

    def soon(self) -> None: ...


class TallyPart(Protocol):
    """retention.py's ``Tally``, as its own functions reach it through the agent."""

    def of(self, db: Store, uid: int | None) -> int: ...
    def add(self, uid: int | None, size: int) -> None: ...


class MetricsPart(Protocol):
    """metrics.py's ``Metrics``, as reload.py uses it."""

    def configure(self) -> None: ...
