"""Reading the queue: ``list`` (header, fixed columns, filters, fields, times), ``cancel`` of
several jobs or by filter, ``status`` with no jobs, and a closed stdout.

Issue 13, friction 4 (no header, filters, times or user column; long names shift columns; a
BrokenPipe traceback under ``head``; ``cancel`` takes one id) and friction 10 (``status``
prints a bare ``jobs`` line).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.helpers import CLI, Node, poll_until

LONG = "a-job-name-much-longer-than-its-column-ever-is"


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node(cpus=2)
    try:
        n.start()
        yield n
    finally:
        n.cleanup()


@pytest.fixture(scope="module")
def jobs(node: Node) -> dict[str, int]:
    """Two ended jobs (one with a long name), one running and one pending behind it."""
    done = node.submit("true", opts=("--name", LONG))
    failed = node.submit("sh", "-c", "exit 3", opts=("--name", "bad"))
    node.wait_end(done)
    node.wait_end(failed)
    running = node.submit("sleep", "60", opts=("--cpus", "2", "--name", "long"))
    node.wait_state(running, ("running",))
    pending = node.submit("sleep", "60", opts=("--name", "waiter"))
    return {"done": done, "failed": failed, "running": running, "pending": pending}


def column(lines: list[str], header: str, right: bool = False) -> list[str]:
    """The text under ``header``, by the header's offset: it holds only if columns are fixed
    (a right-aligned column: what lies under the header's own characters)."""
    start = lines[0].index(header)
    if right:
        return [line[start:start + len(header)].strip() for line in lines[1:]]
    return [line[start:].split("  ")[0].strip() for line in lines[1:]]


def test_status_with_no_jobs_says_none() -> None:
    n = Node(cpus=1)
    try:
        n.start()
        lines = n.ok("status").splitlines()
        jobs_line = [line for line in lines if line.split()[0] == "jobs"]
        assert jobs_line and jobs_line[0].split() == ["jobs", "none"], lines
    finally:
        n.cleanup()


def test_list_has_a_header_and_fixed_columns(node: Node, jobs: dict[str, int]) -> None:
    lines = node.ok("list").splitlines()
    assert lines[0].split() == ["ID", "USER", "NAME", "STATE", "EXIT", "START", "ELAPSED",
                                "REASON", "COMMAND"]
    assert len(lines) == 1 + len(jobs)
    # the long name is cut, and STATE and EXIT still line up under their headers
    assert column(lines, "STATE") == ["completed", "failed", "running", "pending"]
    assert column(lines, "EXIT", right=True) == ["0", "3", "-", "-"]
    assert column(lines, "USER") == ["root"] * 4
    name = column(lines, "NAME")[0]
    assert name.endswith("+") and LONG.startswith(name[:-1])
    assert column(lines, "START")[0].startswith(time.strftime("%Y-"))
    assert column(lines, "START")[3] == ""  # pending: not started


def test_list_filters(node: Node, jobs: dict[str, int]) -> None:
    def ids(*args: str) -> list[int]:
        return [j["id"] for j in json.loads(node.ok("list", "--json", *args))]

    assert ids("--state", "running") == [jobs["running"]]
    assert ids("--state", "PD,CD") == [jobs["done"], jobs["pending"]]
    assert ids("--state", "active") == [jobs["running"], jobs["pending"]]
    assert ids("--name", f"bad,{LONG}") == [jobs["done"], jobs["failed"]]
    assert ids("--user", "root", "--state", "failed") == [jobs["failed"]]
    assert ids("--user", "nobody") == []
    later = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 3600))
    assert ids("--since", later) == [jobs["running"], jobs["pending"]]  # not ended before it
    assert ids("--since", "1h") == sorted(jobs.values())
    # the table obeys the same filters
    assert node.ok("list", "--state", "failed", "--no-header").split()[:4] == [
        str(jobs["failed"]), "root", "bad", "failed"]


def test_list_json_is_the_job_objects_unchanged(node: Node, jobs: dict[str, int]) -> None:
    listed = json.loads(node.ok("list", "--json"))
    settled = [j for j in listed if j["state"] in ("completed", "failed")]
    assert [j["id"] for j in settled] == [jobs["done"], jobs["failed"]], listed
    for j in settled:  # settled: show gives the same object
        assert j == node.job(j["id"])


def test_list_format_by_field_names(node: Node, jobs: dict[str, int]) -> None:
    out = node.ok("list", "--format", "id,name:6,state,elapsed,end,limit", "--state", "ended")
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "NAME", "STATE", "ELAPSED", "END", "LIMIT"]
    first = lines[1].split()
    assert first[1] == "a-job+" and first[2] == "completed"
    assert first[3].count(":") == 1  # M:SS
    assert first[4].startswith(time.strftime("%Y-"))
    cmd = node.ok("list", "--format", "id,command", "--name", "bad", "--no-header").split()
    assert cmd == [str(jobs["failed"]), "sh", "-c", "exit", "3"]


@pytest.mark.parametrize("argv, fragment", [
    (["--format", "id,nosuch"], "unknown field 'nosuch'"),
    (["--format", "id:0"], "width"),
    (["--state", "sleeping"], "unknown state 'sleeping'"),
    (["--since", "yesterday"], "is not a time"),
])
def test_list_bad_options_are_one_line(node: Node, argv: list[str], fragment: str) -> None:
    res = node.cli("list", *argv)
    assert res.returncode == 2
    assert fragment in res.stderr and res.stderr.count("\n") == 1, res.stderr


@pytest.mark.parametrize("argv", [["list"], ["list", "--json"], ["status"], ["show", "1"],
                                  ["--help"], ["submit", "--help"]])
def test_closed_stdout_is_no_traceback(node: Node, jobs: dict[str, int], argv: list[str]) -> None:
    """As ``tether list | head -0``: the reader is gone before the first write."""
    r, w = os.pipe()
    os.close(r)
    try:
        res = subprocess.run([*CLI, *argv], stdout=w, stderr=subprocess.PIPE, text=True,
                             env=node.env, timeout=60)
    finally:
        os.close(w)
    assert res.stderr == "", res.stderr
    assert res.returncode == 141


def test_cancel_several_and_by_filter(node: Node, jobs: dict[str, int]) -> None:
    a = node.submit("sleep", "60", opts=("--name", "batch-a"))
    b = node.submit("sleep", "60", opts=("--name", "batch-a"))
    c = node.submit("sleep", "60", opts=("--name", "batch-b"))
    d = node.submit("sleep", "60", opts=("--name", "batch-b"))
    # several ids at once; an unknown one is reported on its own line, the rest still go
    res = node.cli("cancel", str(a), "999999", str(c))
    assert res.returncode == 1 and res.stderr.strip() == "tether: no job 999999"
    assert node.job(a)["state"] == node.job(c)["state"] == "cancelled"
    # by name: only the jobs still active (the cancelled batch-a job is not an error)
    node.ok("cancel", "--name", "batch-a,batch-b")
    assert node.job(b)["state"] == node.job(d)["state"] == "cancelled"
    # by state: every pending job and no other
    node.ok("cancel", "--state", "pending")
    assert node.job(jobs["pending"])["state"] == "cancelled"
    assert node.job(jobs["running"])["state"] == "running"
    # ids and a filter: the named jobs the filter lets through
    node.ok("cancel", str(jobs["running"]), "--user", "nobody")
    assert node.job(jobs["running"])["state"] == "running"
    node.ok("cancel", str(jobs["running"]), "--user", "root")
    poll_until(lambda: node.job(jobs["running"])["state"] == "cancelled", 30,
               "the running job to be cancelled")


def test_cancel_needs_jobs_or_filters(node: Node) -> None:
    res = node.cli("cancel")
    assert res.returncode == 2 and "name the jobs" in res.stderr
