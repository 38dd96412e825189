"""A single node's scheduling features, cluster-wide (issue 25): time limits, arrays with their
tokens and throttle, dependencies across nodes, begin times, suspend and resume on the job's
node. Two agents on a real PostgreSQL (``tests/clusterkit.py``)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import time

from tests.clusterkit import GATE, Cluster
from tests.helpers import CLI, poll_until


def test_a_time_limit_is_enforced_wherever_the_job_runs(cluster: Cluster) -> None:
    cluster.agents("n0", "n1")
    job = cluster.submit("sleep", "60", opts=("--time", "0:02"))
    row = cluster.wait_job(job, lambda j: j["state"] == "timeout", "timeout", timeout=60)
    assert row["time_limit"] == 2.0 and "time limit" in row["reason"]
    res = cluster.cli("wait", str(job))
    assert res.returncode == 143, res.stderr  # SIGTERM at the limit, as on one node


def test_an_array_runs_across_nodes_with_its_tokens_and_throttle(cluster: Cluster) -> None:
    cluster.agents("n0", "n1")
    first = cluster.submit("sh", "-c", GATE + "; echo $TETHER_ARRAY_JOB_ID $TETHER_ARRAY_TASK_ID",
                           opts=("--array", "0-5%2", "--output", "o-%A_%a-%N.txt"))
    rows = cluster.sql("SELECT id, array_id, array_index, array_max FROM tether_jobs ORDER BY id")
    assert [(r["array_id"], r["array_index"], r["array_max"]) for r in rows] == \
        [(first, i, 2) for i in range(6)]

    def running() -> int:
        return len(cluster.sql("SELECT id FROM tether_jobs WHERE state IN ('starting', "
                               "'running')"))
    poll_until(lambda: running() == 2, 30, "two elements running (the throttle)")
    pending = json.loads(cluster.ok("show", str(rows[5]["id"]), "--json"))
    assert pending["state"] == "pending" and pending["array_index"] == 5
    cluster.go()
    seen_most = 0
    deadline = time.monotonic() + 60
    while cluster.sql("SELECT id FROM tether_jobs WHERE state <> 'completed'"):
        seen_most = max(seen_most, running())
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.02)
    assert seen_most <= 2
    nodes = {r["node"] for r in cluster.sql("SELECT node FROM tether_jobs")}
    for r in rows:
        job = cluster.job(r["id"])
        assert job["output"] == os.path.join(cluster.work,
                                              f"o-{first}_{r['array_index']}-%N.txt")
        [path] = glob.glob(os.path.join(cluster.work, f"o-{first}_{r['array_index']}-n?.txt"))
        assert path.endswith(f"-{job['node']}.txt")  # %N: the node that ran it
        with open(path) as f:
            assert f.read() == f"{first} {r['array_index']}\n"
    assert nodes <= {"n0", "n1"}


def test_dependencies_across_nodes(cluster: Cluster) -> None:
    cluster.agents("n0", "n1")
    cluster.ok("drain", "n1")
    before = cluster.submit("sh", "-c", GATE)  # on n0
    after = cluster.submit("sh", "-c", "echo after", opts=("--dependency", f"afterok:{before}"),
                           node="n1")
    never = cluster.submit("true", opts=("--dependency", f"afternotok:{before}"))
    anyway = cluster.submit("true", opts=("--dependency", f"afterany:{after}"))
    cluster.ok("resume", "n1")
    shown = json.loads(cluster.ok("show", str(after), "--json"))
    assert (shown["state"], shown["reason"]) == ("pending", "Dependency")
    assert shown["dependency"] == [f"afterok:{before}"]
    cluster.go()
    for job in (before, after, anyway):
        cluster.wait_job(job, lambda j: j["state"] == "completed", "completed")
    row = cluster.wait_job(never, lambda j: j["state"] == "cancelled", "cancelled")
    assert row["reason"].startswith("DependencyNeverSatisfied")
    res = cluster.cli("submit", "--dependency", "afterok:999", "--", "true")
    assert res.returncode == 1 and "no job 999" in res.stderr


def test_a_begin_time_holds_the_job_until_then(cluster: Cluster) -> None:
    cluster.agents("n0", "n1")
    job = cluster.submit("true", opts=("--begin", "now+2"))
    shown = json.loads(cluster.ok("show", str(job), "--json"))
    assert (shown["state"], shown["reason"]) == ("pending", "BeginTime")
    row = cluster.wait_job(job, lambda j: j["state"] == "completed", "completed")
    assert row["begin_at"] is not None


def test_suspend_and_resume_from_any_node(cluster: Cluster) -> None:
    cluster.agents("n0", "n1")
    cluster.ok("drain", "n1")
    job = cluster.submit("sleep", "60")
    cluster.wait_job(job, lambda j: j["state"] == "running" and j["pids"], "running on n0")
    cluster.ok("suspend", str(job), node="n1")  # asked of n0 through the database
    local = [j for j in cluster.local_jobs("n0")]
    assert local and local[0]["state"] == "running"  # frozen, its row still running
    status = json.loads(cluster.ok("status", "--json", node="n0"))
    assert status["cluster"]["node"] == "n0"
    res = cluster.cli("suspend", str(job), node="n0")
    assert res.returncode == 1 and "already suspended" in res.stderr, res.stderr
    cluster.ok("resume", str(job), node="n0")
    cluster.ok("cancel", str(job))
    cluster.wait_job(job, lambda j: j["state"] == "cancelled", "cancelled")


def test_inspect_attach_and_signal_from_another_node(cluster: Cluster) -> None:
    """Through n1's agent and the database to n0's supervisor: no DSN, no port, no ssh."""
    cluster.agents("n0", "n1")
    cluster.ok("drain", "n1")
    script = ("trap 'echo got USR1' USR1; echo one; "
              "while [ ! -e go ]; do sleep 0.05; done; echo two; "
              "while [ ! -e go2 ]; do sleep 0.05; done; echo three")
    job = cluster.submit("sh", "-c", script)
    row = cluster.wait_job(job, lambda j: j["state"] == "running" and j["pids"], "running")
    assert row["node"] == "n0"
    st = json.loads(cluster.ok("inspect", str(job), "--json", node="n1"))
    assert st["state"] == "running" and st["pids"] == row["pids"]
    pids = json.loads(cluster.ok("inspect", str(job), "--pids", "--json", node="n1"))
    assert [t["pid"] for t in pids["tasks"]] == row["pids"]
    poll_until(lambda: "one" in cluster.ok("inspect", str(job), "--output", node="n1"), 15,
               "its output through the relay")
    cluster.ok("signal", str(job), "USR1", node="n1")
    poll_until(lambda: "got USR1" in cluster.ok("inspect", str(job), "--output", node="n1"),
               15, "the signal to arrive")
    attach = subprocess.Popen([*CLI, "attach", str(job)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, TETHER_STATE_DIR=cluster.nodes["n1"].state))
    try:
        assert attach.stdout is not None
        lines = iter(attach.stdout.readline, "")
        assert next(lines) == "one\n"  # replayed from the start
        while next(lines) != "got USR1\n":  # the shell may say its sleep died of it first
            pass
        cluster.go()
        assert next(lines) == "two\n"  # live, through the relay
        open(os.path.join(cluster.work, "go2"), "w").close()
        assert next(lines) == "three\n"
        assert attach.wait(timeout=60) == 0
    finally:
        if attach.poll() is None:
            attach.kill()
            attach.wait()
        if attach.stdout is not None:
            attach.stdout.close()
    cluster.wait_job(job, lambda j: j["state"] == "completed", "completed")


def test_acct_shows_the_clusters_ended_jobs_with_what_they_used(cluster: Cluster) -> None:
    cluster.agents("n0", "n1")
    cluster.ok("drain", "n1")
    job = cluster.submit("sh", "-c", "head -c 60000000 /dev/zero | tail -c 1 >/dev/null")
    cluster.wait_job(job, lambda j: j["state"] == "completed", "completed")
    rows = json.loads(cluster.ok("acct", "--json", node="n1"))  # from another node
    [row] = [r for r in rows if r["id"] == job]
    assert (row["node"], row["state"], row["exit_code"], row["user"]) == \
        ("n0", "completed", 0, "root")
    assert row["cpu_total"] is not None and row["elapsed"] is not None
    assert row["maxrss_kb"] and row["maxrss_kb"] > 0
    failed = cluster.submit("sh", "-c", "exit 3")
    cluster.wait_job(failed, lambda j: j["state"] == "failed", "failed")
    rows = json.loads(cluster.ok("acct", "--json", "--state", "failed", node="n0"))
    assert [r["id"] for r in rows] == [failed]


def test_a_batch_script_runs_as_submitted_wherever_it_runs(cluster: Cluster) -> None:
    """The copy taken at submit runs on the claiming node, with its directives applied."""
    cluster.agents("n0", "n1")
    cluster.ok("drain", "n0")  # it runs on n1; submitted through n0
    path = os.path.join(cluster.work, "job.sh")
    with open(path, "w") as f:  # not executable: run by its #! interpreter
        f.write("#!/bin/sh\n#TETHER --ntasks 2\n#SBATCH --job-name batchy\n"
                "while [ ! -e go ]; do sleep 0.05; done\n"
                "echo as-submitted $TETHER_NTASKS $TETHER_CLUSTER_JOB_ID\n")
    job = int(cluster.ok("submit", path, node="n0").strip())
    with open(path, "w") as f:
        f.write("#!/bin/sh\necho edited\n")  # after submit: changes nothing
    row = cluster.wait_job(job, lambda j: j["state"] == "running", "running")
    assert (row["node"], row["name"], row["ntasks"]) == ("n1", "batchy", 2)
    cluster.go()
    row = cluster.wait_job(job, lambda j: j["state"] == "completed", "completed")
    with open(row["output"]) as f:
        assert f.read() == f"as-submitted 2 {job}\n" * 2


def test_a_node_that_cannot_start_steps_gives_its_runs_back_and_drains_itself(
        cluster: Cluster) -> None:
    """A broken install must not fail the cluster's queue: runs it could not start go back
    (even --no-requeue ones: they never ran), and after a few in a row it takes no more."""
    n0, _ = cluster.agents("n0", "n1", env={"n0": {"TETHER_AGENT_FAULT": "spawn-fails"}})
    cluster.ok("drain", "n1")
    jobs = [cluster.submit("true", opts=("--no-requeue",)) for _ in range(4)]
    poll_until(lambda: cluster.node("n0")["state"] == "draining", 60, "n0 to drain itself")
    # the reason is the contract of the log line: the database keeps only the drain flag
    assert "drained itself: 3 jobs in a row could not be started here" in n0.logs()
    assert n0.logs().count("drained itself") == 1
    cluster.ok("resume", "n1")
    for job in jobs:
        row = cluster.wait_job(job, lambda j: j["state"] == "completed", "run on n1")
        assert row["node"] == "n1"
    reasons = [a["reason"] or "" for j in jobs for a in cluster.attempts(j) if a["node"] == "n0"]
    assert reasons and all("could not start it" in r for r in reasons), reasons
