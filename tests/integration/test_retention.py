"""The state directory cannot be filled by a user (issue 27, point 4): each user's job records
are bounded, ended jobs leave the jobs table after a retention (a count per user, and days)
while the accounting history keeps them, the supervisors' log is kept under a size, and a full
disk loses nothing."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import Node, poll_until
from tests.integration.test_state_dir_full import UNTIL_GO, _fill, _phase
from tests.userkit import User, cli_as, home_for, made_users, ok_as, shared
from tether.agent.retention import rotate_log

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def table_ids(node: Node) -> set[int]:
    """The ids in the jobs table (from the database itself: what `list` pages through)."""
    with sqlite3.connect(f"file:{node.layout.db}?mode=ro", uri=True) as db:
        return {int(r[0]) for r in db.execute("SELECT id FROM jobs")}


def history(node: Node) -> dict[int, str]:
    """The accounting history: each job's final state."""
    with sqlite3.connect(f"file:{node.layout.db}?mode=ro", uri=True) as db:
        return {int(r[0]): str(r[1]) for r in db.execute("SELECT job, state FROM job_acct")}


@pytest.fixture
def two() -> Iterator[list[User]]:
    with made_users(2) as users:
        yield users


def test_ended_jobs_past_the_count_leave_the_table_for_the_history(make_node: Any) -> None:
    node: Node = make_node(extra=["--keep-ended-count", "2"])
    node.start()
    jobs = []
    for _ in range(5):  # one after the other: the newest ended last
        jobs.append(node.submit("true"))
        assert node.wait_end(jobs[-1])["state"] == "completed"
    poll_until(lambda: table_ids(node) == set(jobs[-2:]), 20, "the 3 oldest to be purged")
    assert all(history(node).get(j) == "completed" for j in jobs), history(node)
    res = node.cli("show", str(jobs[0]))
    assert res.returncode == 1 and "purged" in res.stderr and "tether acct" in res.stderr, res
    # an array is purged whole: kept while one of its elements is among the newest two
    arr = int(node.ok("submit", "--array", "0-2", "--", "true").strip())
    node.wait_end(arr)
    elements = set(range(arr, arr + 3))
    poll_until(lambda: table_ids(node) == elements, 20, "the jobs before the array purged")
    later = []
    for _ in range(2):
        later.append(node.submit("true"))
        node.wait_end(later[-1])
    poll_until(lambda: table_ids(node) == set(later), 20, "the array purged, whole")
    assert all(history(node).get(j) == "completed" for j in elements)


def test_ended_jobs_older_than_keep_ended_are_purged(make_node: Any) -> None:
    node: Node = make_node(extra=["--keep-ended", "0.00003"])  # 2.6 seconds
    node.start()
    job = node.submit("true")
    node.wait_end(job)
    assert job in table_ids(node)
    poll_until(lambda: job not in table_ids(node), 20, "the ended job to be purged")
    assert history(node)[job] == "completed"
    kept = node.submit("sh", "-c", "while [ ! -e go ]; do sleep 0.05; done")
    node.wait_state(kept, ("running",))
    assert kept in table_ids(node), "a running job is never purged"
    open(os.path.join(node.work, "go"), "w").close()
    node.wait_end(kept)


#: ~300 KB of environment (execve takes at most 128 KiB per string)
BIG_ENV = {f"BIG{i}": "x" * 100_000 for i in range(3)}


@needs_root
def test_a_users_records_are_bounded_her_ended_jobs_purged_first(make_node: Any,
                                                                 two: list[User]) -> None:
    """At most 1 MiB of records for alice: her ended jobs make room for new ones, and once
    none is left, a submission is refused in one line; bob is not affected."""
    node: Node = make_node(extra=["--max-user-records-mb", "1"])
    alice, bob = two
    shared(node)
    node.start()
    work = home_for(node, alice)

    def submit(*opts: str) -> subprocess.CompletedProcess[str]:
        return cli_as(alice, node, "submit", "--workdir", work, "--output", "/dev/null", *opts,
                      "--", "true", env=BIG_ENV)

    ended = []
    for _ in range(2):
        res = submit()
        assert res.returncode == 0, res.stderr
        ended.append(int(res.stdout))
        assert node.wait_end(ended[-1])["state"] == "completed"
    held = []
    for _ in range(3):  # 900 KB held, then 1.2 MB and 1.5 MB: her two ended jobs go
        res = submit("--hold")
        assert res.returncode == 0, res.stderr
        held.append(int(res.stdout))
    assert not set(ended) & table_ids(node), "her ended jobs were not purged to make room"
    assert {history(node)[j] for j in ended} == {"completed"}
    refused = submit("--hold")
    assert refused.returncode == 1, refused.stdout
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "--max-user-records-mb" in refused.stderr, refused.stderr
    # bob has his own share
    bob_work = home_for(node, bob)
    ok_as(bob, node, "submit", "--workdir", bob_work, "--output", "/dev/null", "--hold", "--",
          "true", env=BIG_ENV)
    node.ok("cancel", *map(str, held))


@pytest.fixture
def small_node() -> Iterator[Node]:
    """A node whose state directory is a 4 MiB tmpfs of its own, keeping one ended job."""
    n = Node(cpus=4, extra=["--keep-ended-count", "1"])
    os.makedirs(n.state)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", n.state],
                   check=True)
    try:
        yield n
    finally:
        n.cleanup()
        subprocess.run(["umount", "-l", n.state], check=False)
        shutil.rmtree(n.dir, ignore_errors=True)


@needs_root
def test_a_full_disk_while_jobs_end_and_are_purged_loses_nothing(small_node: Node) -> None:
    node = small_node
    node.start()
    jobs = [node.submit(*UNTIL_GO) for _ in range(3)]
    for job in jobs:
        node.wait_state(job, ("running",))
    filler = os.path.join(node.state, "filler")
    _fill(filler)
    open(os.path.join(node.work, "go"), "w").close()
    for job in jobs:
        poll_until(lambda j=job: _phase(node, j) == "exited", 30, f"job {job}'s step to end")
    os.unlink(filler)
    # every result recorded, then all but the newest purged: each in the history, completed
    poll_until(lambda: len(table_ids(node)) == 1 and set(history(node)) >= set(jobs), 30,
               "the results recorded and the ended jobs purged")
    assert {history(node)[j] for j in jobs} == {"completed"}, history(node)
    later = node.submit("true")
    assert node.wait_end(later)["state"] == "completed"


def test_the_supervisors_log_is_rotated_past_its_size() -> None:
    top = tempfile.mkdtemp(prefix="ttlog")
    try:
        path = os.path.join(top, "supervisors.log")
        writer = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(writer, b"a" * 5000)
        dir_fd = os.open(top, os.O_RDONLY)
        try:
            assert not rotate_log(dir_fd, 10_000)
            os.write(writer, b"b" * 6000)
            assert rotate_log(dir_fd, 10_000)
        finally:
            os.close(dir_fd)
        os.write(writer, b"after\n")  # a supervisor's own fd goes on at the new end
        os.close(writer)
        with open(path, "rb") as f:
            assert f.read() == b"after\n"
        with open(path + ".1", "rb") as f:
            assert f.read() == b"a" * 5000 + b"b" * 6000
    finally:
        shutil.rmtree(top)
