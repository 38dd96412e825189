"""Accounting (issue 28, point 2): at a step's end its supervisor records what it used (CPU time
in user and system mode, the memory peak, from the step's cgroup, else the tasks' rusage), the
agent keeps it with how the job ended in a table of its own, and ``tether acct`` (Slurm's
``sacct``) lists ended jobs, filtered by user, state, name and time, in columns, ``|``-separated
or as JSON; the history outlives the job's row in the jobs table (a purge)."""

from __future__ import annotations

import json
import math
import signal
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import Node, poll_until
from tests.userkit import User, home_for, made_users, ok_as, shared
from tether.shared import stamps

#: dd reads 100 MiB from /dev/zero into one buffer: its memory, with little else around it
HUNDRED_MB = ("dd", "if=/dev/zero", "of=/dev/null", "bs=100M", "count=1")
MB_100_KB = 100 * 1024


def acct(node: Node, *args: str) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = json.loads(node.ok("acct", "--json", *args))
    return result


@pytest.mark.parametrize("cgroup", ["auto", "none"])
def test_acct_shows_the_max_rss_of_a_job_that_allocated_100_mb_within_10_percent(
        make_node: Any, cgroup: str) -> None:
    node: Node = make_node(extra=["--cgroup", cgroup])
    node.start()
    job = node.submit(*HUNDRED_MB)
    assert node.wait_end(job)["state"] == "completed"
    [rec] = acct(node, str(job))
    assert abs(rec["maxrss_kb"] - MB_100_KB) <= MB_100_KB / 10, rec
    mode = node.status()["cgroup"]["mode"]
    if mode in ("v1", "hybrid"):  # v1's memory controller counts the peak
        assert rec["usage_from"] == "cgroup", rec
    elif mode == "none":  # the tasks' rusage then (cgroup v2 before Linux 5.19 too)
        assert rec["usage_from"] == "rusage", rec
    assert abs(rec["task_maxrss_kb"] - MB_100_KB) <= MB_100_KB / 10, rec
    assert rec["cpu_user"] is not None and rec["cpu_system"] > 0  # the kernel zeroed 100 MiB
    assert rec["cpu_total"] == pytest.approx(rec["cpu_user"] + rec["cpu_system"], abs=0.002)
    assert (rec["state"], rec["exit_code"], rec["signal"], rec["oom"]) == (
        "completed", 0, None, False)
    # the table says it the way sacct does: KiB with a K, or in the unit asked for
    line = node.ok("acct", str(job), "-n", "--format", "maxrss,taskmaxrss:12").split()
    assert line == [f"{rec['maxrss_kb']}K", f"{rec['task_maxrss_kb']}K"]
    mib = node.ok("acct", str(job), "-P", "-n", "--format", "maxrss", "--units", "M").strip()
    assert mib == f"{rec['maxrss_kb'] / 1024:.2f}M"


def test_cpu_time_elapsed_exit_and_oom_are_recorded(make_node: Any) -> None:
    node: Node = make_node()
    node.start()
    burn = ("import time\nt = time.process_time() + 1\nwhile time.process_time() < t: pass\n"
            "raise SystemExit(3)")
    busy = node.submit("python3", "-c", burn)
    killed = node.submit("sh", "-c", "kill -USR1 $$")
    oom = node.submit("python3", "-c", "b = bytearray(300 << 20); b[::4096] = b'x' * (75 << 10)",
                      opts=("--mem", "64M"))
    for job in (busy, killed, oom):
        node.wait_end(job)
    recs = {r["id"]: r for r in acct(node)}
    b = recs[busy]
    assert (b["state"], b["exit_code"], b["signal"]) == ("failed", 3, None)
    assert b["elapsed"] >= 1.0 and b["cpu_total"] >= 1.0, b  # a second of CPU, at least
    started, ended = stamps.epoch(b["started_at"]), stamps.epoch(b["ended_at"])
    assert started is not None and ended is not None
    assert b["elapsed"] == pytest.approx(ended - started, abs=0.01)
    assert (recs[killed]["state"], recs[killed]["signal"]) == ("failed", signal.SIGUSR1)
    row = node.ok("acct", str(killed), "-P", "-n", "--format", "id,state,exitcode").strip()
    assert row == f"{killed}|failed|0:{int(signal.SIGUSR1)}"
    if node.status()["cgroup"]["memory_enforced"]:
        o = recs[oom]
        assert (o["state"], o["oom"], o["memory_mb"]) == ("failed", True, 64), o
        assert o["maxrss_kb"] <= 64 * 1024 + 1024, o  # held to its limit, and counted so


def test_filters_formats_and_the_parsable_forms(make_node: Any) -> None:
    node: Node = make_node()
    node.start()
    first = node.submit("true", opts=("-J", "alpha"))
    end = stamps.epoch(node.wait_end(first)["ended_at"])
    assert end is not None
    boundary = math.floor(end) + 1  # --since and --until are in whole seconds
    poll_until(lambda: time.time() >= boundary, 5, "the clock to pass the first job's end")
    mark = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(boundary))
    bad = node.submit("false", opts=("-J", "beta"))
    node.wait_end(bad)
    array = int(node.ok("submit", "-a", "0-1", "-J", "gamma", "--", "true").strip())
    assert node.cli("wait", str(array), "--timeout", "60").returncode == 0
    held = node.submit("true", opts=("-J", "delta", "--hold"))  # not ended: never listed
    node.ok("cancel", str(held))
    ids = [r["id"] for r in acct(node)]
    assert ids == [first, bad, array, array + 1, held]
    assert [r["id"] for r in acct(node, "--state", "failed,CA")] == [bad, held]
    assert [r["id"] for r in acct(node, "--name", "alpha,gamma")] == [first, array, array + 1]
    assert [r["id"] for r in acct(node, str(array))] == [array, array + 1]
    assert [r["id"] for r in acct(node, f"{array}_1", "-j", str(first))] == [first, array + 1]
    assert [r["id"] for r in acct(node, "--user", "root", "--since", mark)] == ids[1:]
    assert [r["id"] for r in acct(node, "--until", mark)] == [first]
    assert acct(node, "--user", "nobody") == []
    rec = acct(node, f"{array}_1")[0]
    assert (rec["array_id"], rec["array_index"], rec["name"], rec["node"]) == (
        array, 1, "gamma", node.status()["node"])

    table = node.ok("acct", "--format", "id,name:6,state,exitcode").splitlines()
    assert table[0].split() == ["ID", "NAME", "STATE", "EXITCODE"]
    assert table[2].split() == [str(bad), "beta", "failed", "1:0"]
    assert table[4].split()[0] == f"{array}_1"
    parsable = node.ok("acct", "-p", "--format", "jobid,name,state").splitlines()
    assert parsable[0] == "JOBID|NAME|STATE|"
    assert parsable[1] == f"{first}|alpha|completed|"
    p2 = node.ok("acct", "-P", "-n", "--format", "jobid,name,state").splitlines()
    assert p2[0] == f"{first}|alpha|completed" and len(p2) == len(ids)
    bad_field = node.cli("acct", "--format", "id,bogus")
    assert bad_field.returncode == 2 and "unknown field 'bogus'" in bad_field.stderr
    both = node.cli("acct", "-p", "--json")
    assert both.returncode == 2


def test_the_history_outlives_the_jobs_table_and_a_dependency_reads_it(node: Node) -> None:
    """A purge of ended jobs (issue 27) deletes their rows; acct still lists them, and a job
    that waited on one of them is judged by how it ended."""
    node.start()
    done = node.submit("true", opts=("-J", "gone"))
    assert node.wait_end(done)["state"] == "completed"
    waiting = node.submit("true", opts=("--hold", "--dependency", f"afterok:{done}"))
    node.stop()
    db = sqlite3.connect(node.layout.db)
    try:
        for table, key in (("jobs", "id"), ("job_sched", "id"), ("job_facts", "job"),
                           ("job_umask", "id"), ("job_cgroup", "job")):
            db.execute(f"DELETE FROM {table} WHERE {key} = ?", (done,))
        db.commit()
    finally:
        db.close()
    node.start()
    assert [j["id"] for j in json.loads(node.ok("list", "--json"))] == [waiting]
    [rec] = acct(node, str(done))
    assert (rec["name"], rec["state"]) == ("gone", "completed")
    node.ok("release", str(waiting))
    assert node.wait_end(waiting)["state"] == "completed"  # afterok judged from the history


@pytest.fixture
def alice() -> Iterator[User]:
    with made_users(1) as users:
        yield users[0]


def test_a_user_sees_her_own_history_unless_she_asks_for_more(node: Node, alice: User) -> None:
    shared(node)
    work = home_for(node, alice)
    node.start()
    mine = int(ok_as(alice, node, "submit", "--", "true", cwd=work).strip())
    roots = node.submit("true")
    node.wait_end(mine)
    node.wait_end(roots)

    def ids(*args: str) -> list[int]:
        return [r["id"] for r in json.loads(ok_as(alice, node, "acct", "--json", *args))]
    assert ids() == [mine]  # sacct's default: her own
    assert ids("--all-users") == [mine, roots]
    assert ids("--user", "root") == [roots]
    assert ids(str(roots)) == [roots]  # named: anyone's, as list and show show them
    assert [r["id"] for r in acct(node)] == [mine, roots]  # root: everyone's
    assert acct(node, str(mine))[0]["user"] == alice.name
