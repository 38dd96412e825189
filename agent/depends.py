"""What a scheduler pass reads to judge the pending jobs' dependencies (I/O): the states of the
jobs and arrays they name, an element's own index (``aftercorr``) and whether another job of
its user and name is in the way (``singleton``). The judgement itself is pure
(``schedule.dependency_state``).

A job that is no longer in the jobs table (purged once ended) is looked up in the accounting
history (``acct.py``), which keeps every ended job's final state: a dependency on it is judged
by how it ended, not as on an unknown job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tether.agent import acct, schedule
from tether.agent.job import Queued

if TYPE_CHECKING:
    from tether.agent.db import Store


class Facts:
    """Read once per pass for every job it examines: the named jobs' and arrays' states."""

    def __init__(self, db: Store, jobs: list[Queued]) -> None:
        self.db = db
        refs = {ref for job in jobs for _, ref in job.dependency}
        ids = {ref for ref in refs if ref > 0}
        self.states = db.states_of(ids)
        missing = ids - self.states.keys()
        if missing:
            self.states.update(acct.states_of(db, missing))
        self.arrays = {-ref: element_states(db, -ref) for ref in refs if ref < 0}

    def state(self, job: Queued) -> str:
        """``schedule.dependency_state`` of ``job``."""
        kinds = {kind for kind, _ in job.dependency}
        index = own_index(self.db, job.id) if "aftercorr" in kinds else None
        busy = singleton_busy(self.db, job.id) if "singleton" in kinds else False
        return schedule.dependency_state(job.dependency, self.states, self.arrays, index, busy)


def element_states(db: Store, array_id: int) -> dict[int, str]:
    """Each element of the array by its index: its state (from the accounting history for an
    element no longer in the jobs table)."""
    rows = db.conn.execute(
        "SELECT s.array_index, j.state FROM job_sched s JOIN jobs j ON j.id = s.id "
        "WHERE s.array_id = ?", (array_id,))
    out = {int(index): str(state) for index, state in rows if index is not None}
    for index, state in acct.array_states(db, array_id).items():
        out.setdefault(index, state)
    return out


def own_index(db: Store, job_id: int) -> int | None:
    row = db.conn.execute("SELECT array_index FROM job_sched WHERE id = ?", (job_id,)).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def singleton_busy(db: Store, job_id: int) -> bool:
    """Slurm's ``singleton``: another job of the same user and name is active (starting,
    running or suspended), or pending ahead of this one (a lower id)."""
    row = db.conn.execute("SELECT uid, name FROM jobs WHERE id = ?", (job_id,)).fetchone()
    if row is None:
        return False
    uid, name = row
    # two statements, each through the state index (an OR would scan every job ever run)
    active = db.conn.execute(
        "SELECT 1 FROM jobs WHERE state IN ('starting', 'running') AND name = ? AND uid IS ? "
        "AND id != ? LIMIT 1", (name, uid, job_id)).fetchone()
    if active is not None:
        return True
    ahead = db.conn.execute(
        "SELECT 1 FROM jobs WHERE state = 'pending' AND id < ? AND name = ? AND uid IS ? "
        "LIMIT 1", (job_id, name, uid)).fetchone()
    return ahead is not None
