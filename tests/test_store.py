"""The agent's Store on a real SQLite database: ``change`` gives the job exactly as a re-read."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tether.agent.db import Job, Store


def _store(tmp_path: Any) -> Store:
    return Store(os.path.join(str(tmp_path), "jobs.db"))


def _submit(store: Store, job_id: int) -> Job:
    store.insert(id=job_id, name="j", command=["true", "x"], state="pending", cpus_per_task=1,
                 ntasks=2, gpus_req=0, memory_mb=0, output="/o", error="/e", workdir="/w",
                 env={"A": "1", "B": "two"}, submitted_at="2026-12-01T00:00:00.000Z",
                 user="root", uid=0, gid=0)
    return store.get_required(job_id)


CHANGES: list[dict[str, Any]] = [
    # what the agent's transitions write, each as it writes it
    {"state": "starting", "attempt": 1, "cpus": [0, 1], "gpus": [], "pids": [],
     "supervisor_pid": None, "supervisor_ticks": None, "supervisor_boot": None,
     "supervisor_session": None},
    {"supervisor_pid": 42},
    {"state": "running", "pids": [7, 8], "started_at": "2026-12-01T00:00:01.000Z",
     "supervisor_pid": 42, "supervisor_ticks": 99, "supervisor_boot": "b",
     "supervisor_session": 42},
    {"cancel_requested": 1},
    {"cancel_requested": True},
    {"suspended_at": 1.5e9},
    {"suspended_at": None, "suspended_seconds": 3.25},
    {"state": "completed", "exit_code": 0, "signal": None, "reason": None,
     "ended_at": "2026-12-01T00:00:02.000Z", "core_dumped": False, "oom": 0,
     "suspended_at": None, "started_at": "2026-12-01T00:00:01.000Z"},
    {"state": "failed", "exit_code": None, "signal": 9, "reason": "killed",
     "core_dumped": 1, "oom": True},
    {"held": 1, "time_limit": 60.0, "dependency": [["afterok", 3]], "begin_at": 5.0},
    {"array_id": 1, "array_index": 0, "array_max": 2},
    # an identity written in part: job_facts keeps boot and session only with their ticks
    {"supervisor_ticks": 7},
    {"supervisor_boot": "c", "supervisor_session": 1},
]


@pytest.mark.parametrize("fields", CHANGES, ids=lambda f: ",".join(f))
def test_change_returns_the_job_as_a_reread_gives_it(tmp_path: Any, fields: dict[str, Any],
                                                     ) -> None:
    store = _store(tmp_path)
    try:
        job = _submit(store, 1)
        # from a job with an identity recorded too
        job = store.change(job, **CHANGES[2])
        assert job == store.get_required(1)
        changed = store.change(job, **dict(fields))
        assert changed == store.get_required(1)
        assert changed.public() == store.get_required(1).public()
    finally:
        store.close()


def test_changes_in_a_row_follow_the_database(tmp_path: Any) -> None:
    store = _store(tmp_path)
    try:
        job = _submit(store, 5)
        for fields in CHANGES:
            job = store.change(job, **dict(fields))
            assert job == store.get_required(5), fields
    finally:
        store.close()


def test_insert_and_update_read_nothing_back(tmp_path: Any) -> None:
    store = _store(tmp_path)
    try:
        assert store.insert(id=9, name="j", command=["true"], state="pending", cpus_per_task=1,
                            ntasks=1, gpus_req=0, memory_mb=0, output="/o", error="/e",
                            workdir="/w", env={}, submitted_at="2026-12-01T00:00:00.000Z") == 9
        assert store.update(9, state="starting", attempt=1) is None
        assert store.get_required(9).state == "starting"
    finally:
        store.close()
