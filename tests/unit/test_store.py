"""The agent's Store on a real SQLite database: ``change`` gives the job exactly as a re-read."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tether.agent.db import Store
from tether.agent.job import Job


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
    {"state": "completed", "exit_code": 0, "pmi_unused": 1},
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
        # (a suspended job's public suspended_seconds counts up with the clock)
        ours, reread = changed.public(), store.get_required(1).public()
        ours.pop("suspended_seconds")
        reread.pop("suspended_seconds")
        assert ours == reread
    finally:
        store.close()


def test_changes_in_a_row_follow_the_database(tmp_path: Any) -> None:
    store = _store(tmp_path)
    try:
        job = _submit(store, 5)
        for fields in CHANGES:
            before = dict(vars(job))
            changed = store.change(job, **dict(fields))
            assert changed == store.get_required(5), fields
            assert vars(job) == before and changed is not job  # the caller's job is left be
            job = changed
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


def test_every_field_reads_back_as_written(tmp_path: Any) -> None:
    store = _store(tmp_path)
    written: dict[str, Any] = {
        "name": "n", "command": ["c", "1"], "state": "running", "attempt": 3, "exit_code": 4,
        "signal": 5, "reason": "r", "cpus_per_task": 6, "ntasks": 7, "gpus_req": 8,
        "memory_mb": 9, "cpus": [10, 11], "gpus": [12], "supervisor_pid": 13,
        "supervisor_ticks": 14, "pids": [15, 16], "output": "/o", "error": "/e",
        "workdir": "/w", "env": {"K": "v"}, "submitted_at": "s1", "started_at": "s2",
        "ended_at": "s3", "cancel_requested": True, "pmi": "pmi2", "user": "u", "uid": 17,
        "gid": 18, "supervisor_boot": "b", "supervisor_session": 19, "core_dumped": True,
        "time_limit": 20.5, "held": True, "dependency": [("afterok", 21)], "array_id": 22,
        "array_index": 23, "array_max": 24, "begin_at": 25.5, "oom": True,
        "suspended_at": 26.5, "suspended_seconds": 27.5, "pmi_unused": True,
    }
    try:
        first = ("name", "command", "state", "cpus_per_task", "ntasks", "gpus_req",
                 "memory_mb", "output", "error", "workdir", "env", "submitted_at")
        store.insert(id=2, **{k: written[k] for k in first})
        store.update(2, **{k: v for k, v in written.items() if k not in first})
        job = store.get_required(2)
        assert {k: getattr(job, k) for k in written} == written
        assert job.id == 2 and job.pending_reason is None
        assert store.all() == [job] and store.page(0, 5) == [job]
    finally:
        store.close()
