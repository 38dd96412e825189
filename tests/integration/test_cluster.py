"""Many nodes on one real PostgreSQL: three agents on this machine, each with its own state dir
and its own database role (``tests/clusterkit.py`` sets the cluster up as docs/cluster.md says).

The server is Debian's, started once for the module in a temporary directory (Unix socket only,
as the ``postgres`` user since it refuses root); every test gets a fresh database and drops it,
and its roles. Heartbeats every 0.5 s and a 3 s timeout keep the failure cases short. People
talk to an agent (``cluster.cli``); the tests read the database as its owner.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from typing import Any

from tests.clusterkit import GATE, MARGIN, TIMEOUT, Cluster
from tests.helpers import CLI, pid_alive, poll_until
from tests.pgserver import ScratchPostgres


def test_init_is_idempotent_and_bad_input_is_one_line(cluster: Cluster, pg: ScratchPostgres,
                                                      make_node: Any) -> None:
    out = cluster.admin("init").stdout
    assert "version 3" in out and "3s" in out  # a re-init keeps the timeout it was given
    assert cluster.admin("init", "--heartbeat-timeout", "0", check=False).returncode == 2
    standalone = make_node()
    standalone.start()
    cluster.agents("n0")

    def admin(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, "cluster", *args], capture_output=True, text=True,
                              env=dict(os.environ, TETHER_CLUSTER=dsn), timeout=60)

    def node(*args: str, at: Any = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, TETHER_STATE_DIR=(at or standalone).state))
    cases = [
        (admin(pg.dsn(), "add-node", "x"), 1, "cluster init"),  # no schema there
        (admin("postgresql://x@/x?host=/nonexistent", "init"), 1, "cannot reach"),
        (admin("nonsense=1", "init"), 1, "bad cluster DSN"),
        (admin(cluster.dsn, "add-node", "bad/name"), 1, "bad node name"),
        (node("nodes"), 1, "needs a cluster"),
        (node("drain", "n0"), 1, "needs a cluster"),
        (node("resume", "n0"), 1, "needs a cluster"),
        (node("submit", "--no-requeue", "--", "true"), 1, "--no-requeue"),
        (node("show", "99", at=cluster.nodes["n0"]), 1, "no job 99"),
        (node("drain", "ghost", at=cluster.nodes["n0"]), 1, "no node 'ghost'"),
        (node("show", "1_2", at=cluster.nodes["n0"]), 1, "no array elements"),
        (node("submit", "--dependency", "afterok:77", "--", "true", at=cluster.nodes["n0"]),
         1, "dependency: no job 77"),
        (node("agent", "--cluster", cluster.dsn), 2, "--cluster-file"),
    ]
    for res, rc, text in cases:
        assert res.returncode == rc, (res.args, res.stderr)
        assert text in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    cluster.ok("drain", "n0")
    queued = cluster.submit("true")
    res = node("inspect", str(queued), at=cluster.nodes["n0"])
    assert res.returncode == 1 and "runs on no node" in res.stderr, res.stderr


def test_jobs_spread_over_nodes_with_todays_outputs(cluster: Cluster) -> None:
    cluster.agents("n0", "n1", "n2")
    res = cluster.cli("submit", "--cpus", "3", "--", "true")
    assert res.returncode == 1 and "can never run on any node" in res.stderr
    job_sh = GATE + "; echo hi $TETHER_CLUSTER_JOB_ID $TETHER_CLUSTER_ATTEMPT"
    ids = [cluster.submit("sh", "-c", job_sh) for _ in range(3)]
    ids += [cluster.put("sh", "-c", job_sh) for _ in range(3)]
    jobs = [cluster.wait_job(i, lambda j: j["state"] == "running", "running") for i in ids]
    assert {j["node"] for j in jobs} == {"n0", "n1", "n2"}
    nodes = json.loads(cluster.ok("nodes", "--json"))
    assert [(n["state"], n["cpus"], n["running"]) for n in nodes] == \
        [("up", {"total": 2, "allocated": 2}, 2)] * 3
    cluster.go()
    res = cluster.cli("wait", str(ids[0]), node="n2")  # from any node
    assert res.returncode == 0, res.stderr
    for i in ids:
        job = cluster.wait_job(i, lambda j: j["state"] == "completed", "completed")
        assert (job["exit_code"], job["attempt"]) == (0, 1) and job["pids"]
        with open(job["output"]) as f:
            assert f.read() == f"hi {i} 1\n"
    shown = json.loads(cluster.ok("show", str(ids[1]), "--json"))
    assert shown["node"] in ("n0", "n1", "n2") and shown["state"] == "completed"
    listing = cluster.ok("list")
    assert all(re.search(rf"^\s*{i}\s+root\s+sh\s+completed\s+n[012]\s+0\s", listing, re.M)
               for i in ids), listing
    assert listing.splitlines()[0].split()[:6] == ["ID", "USER", "NAME", "STATE", "NODE", "EXIT"]
    assert json.loads(cluster.ok("list", "--json", "--state", "completed")) == [
        json.loads(cluster.ok("show", str(i), "--json")) for i in ids]
    res = cluster.cli("submit", "--wait", "--", "sh", "-c", "exit 3")
    assert res.returncode == 3, res.stderr

    # cancel a running job: its node stops it and reports the end
    job_id = cluster.submit("sleep", "60")
    job = cluster.wait_job(job_id, lambda j: j["state"] == "running" and j["pids"], "running")
    st = json.loads(cluster.ok("inspect", str(job_id), "--json"))  # on the job's node
    assert st["state"] == "running" and st["pids"] == job["pids"]
    assert cluster.cli("signal", str(job_id), "CONT").returncode == 0
    cluster.ok("cancel", str(job_id))
    job = cluster.wait_job(job_id, lambda j: j["state"] == "cancelled", "cancelled")
    poll_until(lambda: not pid_alive(job["pids"][0]), 15, "the cancelled task to die")
    assert cluster.cli("cancel", str(job_id)).returncode == 1

    # a drained node takes nothing new; resumed, it does
    cluster.ok("drain", "n0")
    assert cluster.node("n0")["state"] == "draining"
    ids = [cluster.submit("sleep", "0.2") for _ in range(4)]
    for i in ids:
        assert cluster.wait_job(i, lambda j: j["state"] == "completed", "done")["node"] != "n0"
    cluster.ok("resume", "n0")
    assert cluster.node("n0")["state"] == "up"


def test_a_lost_nodes_jobs_run_elsewhere_only_after_its_steps_fenced_themselves(
        cluster: Cluster) -> None:
    n0, _, _ = cluster.agents("n0", "n1", "n2")
    cluster.ok("drain", "n1")
    cluster.ok("drain", "n2")
    # the first attempt leaves a marker and runs long; any later one ends at once
    again = cluster.put("sh", "-c", "test -e marker && exit 0; touch marker; exec sleep 60")
    once = cluster.submit("sleep", "60", opts=("--no-requeue",))
    first = [cluster.wait_job(i, lambda j: j["state"] == "running" and j["pids"], "running")
             for i in (again, once)]
    assert {j["node"] for j in first} == {"n0"}
    stale = [p for j in first for p in j["pids"]]
    cluster.ok("resume", "n1")
    cluster.ok("resume", "n2")
    assert n0.agent is not None
    n0.agent.send_signal(signal.SIGSTOP)  # n0 stops answering; its supervisors do not
    try:
        def elsewhere() -> dict[str, Any] | None:
            row = cluster.job(again)
            if row["attempt"] < 2:
                return None
            # never two runs at once: attempt 1's tasks died before attempt 2 was claimed
            assert not any(pid_alive(p) for p in stale), "two runs of one job at once"
            return row if row["state"] == "completed" else None
        done = poll_until(elsewhere, 30, f"job {again}: attempt 2 done elsewhere")
        assert (done["attempt"], done["exit_code"]) == (2, 0) and done["node"] in ("n1", "n2")
        failed = cluster.wait_job(once, lambda j: j["state"] == "node_fail", "node_fail")
        assert "--no-requeue" in failed["reason"] and failed["attempt"] == 1
        assert cluster.node("n0")["state"] == "down"
    finally:
        n0.agent.send_signal(signal.SIGCONT)
    poll_until(lambda: cluster.node("n0")["state"] == "up", 15, "n0 to rejoin")
    assert cluster.job(again)["state"] == "completed" and cluster.job(again)["attempt"] == 2
    assert cluster.job(once)["state"] == "node_fail"
    assert [(a["attempt"], a["node"], a["state"]) for a in cluster.attempts(again)] == \
        [(1, "n0", "lost"), (2, done["node"], "completed")]
    # the rows above are the state; how often a result was sent or refused leaves no row of
    # its own (a repeat is refused, the row unchanged): only the agents' logs count it
    assert "fenced: this node's cluster lease is" in n0.logs()
    # n0 drops the fenced run's result: discarded at its reconcile, or refused if reported
    poll_until(lambda: cluster.log_count(
        rf"cluster job {again} attempt 1(: result refused|\): .*discarding its result)") == 1,
        15, "n0 to drop the fenced run's result")
    assert cluster.log_count(rf"cluster job {again} attempt \d: result delivered") == 1


def test_a_fenced_run_whose_node_came_back_in_time_is_requeued(cluster: Cluster) -> None:
    """Stopped past the timeout but back before the margin ran out: its steps fenced, the node
    was never declared down; the fenced run counts as the node's loss, not the job's."""
    n0, n1 = cluster.agents("n0", "n1")
    cluster.ok("drain", "n1")
    job = cluster.put("sh", "-c", "test -e marker && exit 0; touch marker; exec sleep 60")
    row = cluster.wait_job(job, lambda j: j["state"] == "running" and j["pids"], "running")
    cluster.ok("resume", "n1")
    assert n0.agent is not None
    n0.agent.send_signal(signal.SIGSTOP)
    try:
        poll_until(lambda: not pid_alive(row["pids"][0]), TIMEOUT + 10, "the step to fence")
    finally:
        n0.agent.send_signal(signal.SIGCONT)
    done = cluster.wait_job(job, lambda j: j["state"] == "completed", "run again, completed")
    assert done["attempt"] == 2 and "fenced" in cluster.attempts(job)[0]["reason"]


def test_a_database_outage_fences_nothing_and_results_are_delivered_once(
        cluster: Cluster, pg: ScratchPostgres) -> None:
    cluster.agents("n0", "n1", "n2")
    ids = [cluster.put("sh", "-c", GATE) for _ in range(3)]
    rows = [cluster.wait_job(i, lambda j: j["state"] == "running" and j["pids"], "running")
            for i in ids]
    pg.stop()
    try:
        # Stopped past the timeout and the margin: an outage everyone sees, not a lost node.
        # Nothing can be polled for "not fenced": the time must pass.
        time.sleep(TIMEOUT + MARGIN + 1)
        assert all(pid_alive(r["pids"][0]) for r in rows), "a database outage fenced a step"
        cluster.go()

        def all_local_done() -> bool:
            return all(j["state"] == "completed" for name in ("n0", "n1", "n2")
                       for j in cluster.local_jobs(name))
        poll_until(all_local_done, 30, "every job to end on its node")
    finally:
        pg.start()
    for i in ids:
        job = cluster.wait_job(i, lambda j: j["state"] == "completed", "its result")
        assert job["attempt"] == 1
    # Nothing may be declared down once the agents have been back for a whole timeout.
    time.sleep(TIMEOUT + MARGIN + 1)
    assert [cluster.node(n)["state"] for n in ("n0", "n1", "n2")] == ["up"] * 3
    for i in ids:
        assert len(cluster.attempts(i)) == 1 and cluster.job(i)["attempt"] == 1
        assert cluster.log_count(rf"cluster job {i} attempt 1: result delivered") == 1
    assert cluster.log_count("refused") == 0 and cluster.log_count("fenced") == 0


def test_agent_restart_within_timeout_requeues_nothing(cluster: Cluster) -> None:
    cluster.agents("n0", "n1")
    for sig in (signal.SIGKILL, signal.SIGTERM):  # SIGTERM on a busy agent: the node stays up
        job_id = cluster.put("sleep", "3")
        job = cluster.wait_job(job_id, lambda j: j["state"] == "running", "running")
        node = cluster.nodes[job["node"]]
        node.stop(sig)
        assert cluster.node(job["node"])["state"] == "up"
        node.start()
        done = cluster.wait_job(job_id, lambda j: j["state"] == "completed", "done")
        assert (done["attempt"], done["node"]) == (1, job["node"])
        assert len(cluster.attempts(job_id)) == 1
        assert cluster.node(job["node"])["state"] == "up"


def test_sigterm_on_an_idle_agent_takes_its_node_down(cluster: Cluster) -> None:
    n0, _ = cluster.agents("n0", "n1")
    assert n0.stop(signal.SIGTERM) == 0
    node = cluster.node("n0")
    assert node["state"] == "down" and "idle" in node["reason"]
    n0.start()
    poll_until(lambda: cluster.node("n0")["state"] == "up", 15, "n0 back up")


def test_agents_racing_for_jobs_run_each_once(cluster: Cluster) -> None:
    cluster.agents("n0", "n1", cpus=4)
    # one commit, one wake-up for both agents at once
    cluster.sql("BEGIN; " + "; ".join(
        "INSERT INTO tether_jobs (name, command, state, cpus_per_task, ntasks, gpus_req, "
        "memory_mb, output, error, workdir, env, submitted_at, username, uid, gid) VALUES "
        f"('r{i}', '[\"sh\", \"-c\", \"echo {i} >> runs.log\"]', 'pending', 1, 1, 0, 0, "
        f"'{cluster.work}/r.out', '{cluster.work}/r.out', '{cluster.work}', "
        f"'{{\"PATH\": \"/usr/bin:/bin\"}}', 'now', 'root', 0, 0)" for i in range(20))
        + "; SELECT pg_notify('tether_queue', ''); COMMIT")
    ids = [r["id"] for r in cluster.sql("SELECT id FROM tether_jobs ORDER BY id")]
    assert len(ids) == 20
    for i in ids:
        assert cluster.wait_job(i, lambda j: j["state"] == "completed", "done")["attempt"] == 1
        assert len(cluster.attempts(i)) == 1
    with open(os.path.join(cluster.work, "runs.log")) as f:
        assert sorted(f.read().split()) == sorted(str(i) for i in range(20))
    local = [len(cluster.local_jobs(n)) for n in ("n0", "n1")]
    assert sum(local) == 20


def test_the_agent_answers_while_the_database_does_not(cluster: Cluster) -> None:
    """The loop never waits on PostgreSQL: with the server process behind n0's passes stopped
    (a database that takes a statement and never answers), its door still answers."""
    n0, _ = cluster.agents("n0", "n1")
    rows = cluster.sql("SELECT pid FROM pg_stat_activity WHERE application_name = "
                       "'tether-agent n0'")
    assert len(rows) == 1, rows
    backend = int(rows[0]["pid"])
    os.kill(backend, signal.SIGSTOP)
    try:
        def stuck() -> bool:  # no pass completes: the lease is no longer renewed
            return time.time() - os.stat(n0.layout.cluster_lease).st_mtime > 1.0
        poll_until(stuck, 15, "n0's passes to hang on the stopped server")
        res = cluster.cli("status", "--json", node="n0", timeout=30)
        assert res.returncode == 0 and json.loads(res.stdout)["node"] == "n0", res.stderr
        job = cluster.submit("true", node="n0")  # its users' requests have their own worker
        assert cluster.wait_job(job, lambda j: j["state"] == "completed", "run on n1")["node"] \
            == "n1"
    finally:
        os.kill(backend, signal.SIGCONT)
    poll_until(lambda: time.time() - os.stat(n0.layout.cluster_lease).st_mtime < 1.0, 30,
               "n0's passes to go on")


def test_a_node_confirmed_dead_has_its_jobs_run_elsewhere_at_once(cluster: Cluster) -> None:
    """The administrator knows the node is off: no waiting for the timeout. The site's
    default (--requeue no) ends a lost node's jobs node_fail unless they were given --requeue
    ... or, here, requeues what the default lets it."""
    n0, _ = cluster.agents("n0", "n1")
    cluster.ok("drain", "n1")
    again = cluster.put("sh", "-c", "test -e marker && exit 0; touch marker; exec sleep 60")
    cluster.admin("init", "--requeue", "no")  # the site's default from now on
    once = cluster.submit("sleep", "60")
    rows = [cluster.wait_job(i, lambda j: j["state"] == "running" and j["pids"], "running")
            for i in (again, once)]
    assert cluster.job(again)["requeue"] and not cluster.job(once)["requeue"]
    cluster.ok("resume", "n1")
    res = cluster.admin("node-down", "n0", check=False)
    assert res.returncode == 2 and "--confirm-dead" in res.stderr
    n0.cleanup()  # the node, and every process of its jobs, gone
    assert not any(pid_alive(p) for r in rows for p in r["pids"])
    out = json.loads(cluster.admin("node-down", "n0", "--confirm-dead", "--json").stdout)
    assert (out["requeued"], out["ended"]) == ([again], [once])
    done = cluster.wait_job(again, lambda j: j["state"] == "completed", "run on n1")
    assert (done["attempt"], done["node"]) == (2, "n1")
    assert "confirmed dead by the administrator" in cluster.attempts(again)[0]["reason"]
    assert cluster.job(once)["state"] == "node_fail"
    assert cluster.node("n0")["state"] == "down"
    assert cluster.admin("node-down", "ghost", "--confirm-dead", check=False).returncode == 1
