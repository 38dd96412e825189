"""Many nodes on one real PostgreSQL: three agents on this machine, each with its own state dir.

The server is Debian's, started once for the module in a temporary directory (Unix socket only,
as the ``postgres`` user since it refuses root); every test gets a fresh database and drops it.
Heartbeats every 0.5 s and a 3 s timeout keep the failure cases short.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from tests.helpers import CLI, Node, pid_alive, poll_until
from tests.pgserver import ScratchPostgres
from tether.shared import cluster_db
from tether.shared.cluster_sql import node_state
from tether.shared.timers import rfc3339_now

HEARTBEAT = "0.5"
TIMEOUT = 3.0
#: a job that holds its CPUs until the test opens the gate (Cluster.go)
GATE = "while [ ! -e go ]; do sleep 0.05; done"

if not shutil.which("initdb", path="/usr/lib/postgresql/15/bin") and not any(
        os.path.exists(f"/usr/lib/postgresql/{v}/bin/postgres") for v in range(12, 30)):
    pytest.skip("PostgreSQL server not installed (scripts/setup.sh installs it)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def pg() -> Iterator[ScratchPostgres]:
    server = ScratchPostgres()
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


class Cluster:
    def __init__(self, pg: ScratchPostgres, make_node: Any) -> None:
        self.pg = pg
        self.make_node = make_node
        self.db = "t" + uuid.uuid4().hex[:10]
        self.dsn = pg.create_db(self.db)
        self.work = tempfile.mkdtemp(dir="/tmp", prefix="ttw")
        self.nodes: dict[str, Node] = {}
        self.ok("cluster", "init", "--heartbeat-timeout", str(TIMEOUT))

    def cli(self, *args: str, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, "--cluster", self.dsn, *args], capture_output=True,
                              text=True, cwd=self.work, timeout=timeout,
                              env=dict(os.environ, **(env or {})))

    def ok(self, *args: str) -> str:
        res = self.cli(*args)
        assert res.returncode == 0, f"tether {' '.join(args)}: rc={res.returncode} " \
                                    f"{res.stderr}\n{self.logs()}"
        return res.stdout

    def submit(self, *command: str, opts: tuple[str, ...] = ()) -> int:
        """Through the CLI (what people do)."""
        return int(self.ok("submit", *opts, "--", *command).strip())

    def put(self, *command: str, requeue: bool = True) -> int:
        """Straight into the database, as the CLI would (fast: no interpreter start)."""
        conn = cluster_db.open_checked(self.dsn)
        try:
            job = cluster_db.submit(conn, {
                "name": command[0], "command": list(command), "cpus_per_task": 1, "ntasks": 1,
                "gpus_req": 0, "memory_mb": 0, "workdir": self.work,
                "env": {"PATH": os.environ["PATH"]}, "submitted_at": rfc3339_now(),
                "pmi": "none", "username": "root", "uid": 0, "gid": 0, "requeue": requeue},
                None, None)
        finally:
            conn.close()
        return int(job["id"])

    def go(self) -> None:
        """Open the gate of every job running GATE."""
        open(os.path.join(self.work, "go"), "w").close()

    def agents(self, *names: str, cpus: int = 2) -> list[Node]:
        made = []
        for name in names:
            node = self.make_node(cpus=cpus, extra=["--cluster", self.dsn, "--node", name,
                                                    "--heartbeat", HEARTBEAT])
            self.nodes[name] = node
            node.start(wait=False)
            made.append(node)
        for node in made:
            poll_until(node.agent_answers, 30, "the agent to answer `status`")
        for name in names:
            poll_until(lambda n=name: self.node(n)["state"] == "up", 30, f"node {name} up")
        return made

    def sql(self, query: str, *params: Any) -> list[dict[str, Any]]:
        with psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row) as conn:
            return conn.execute(query, params or None).fetchall()

    def job(self, job_id: int) -> dict[str, Any]:
        rows = self.sql("SELECT * FROM tether_jobs WHERE id = %s", job_id)
        assert rows, f"no job {job_id}"
        return rows[0]

    def node(self, name: str) -> dict[str, Any]:
        rows = self.sql("SELECT * FROM tether_nodes WHERE name = %s", name)
        if not rows:
            return {"state": "absent"}
        return dict(rows[0], state=node_state(rows[0]["state"], rows[0]["drain"]))

    def wait_job(self, job_id: int, pred: Any, what: str, timeout: float = 30) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            job = self.job(job_id)
            return job if pred(job) else None
        return poll_until(check, timeout, f"job {job_id}: {what}")

    def attempts(self, job_id: int) -> list[dict[str, Any]]:
        return self.sql("SELECT * FROM tether_attempts WHERE job = %s ORDER BY attempt", job_id)

    def logs(self) -> str:
        return "\n".join(f"=== node {name}\n{n.logs()}" for name, n in self.nodes.items())

    def log_count(self, pattern: str) -> int:
        return sum(len(re.findall(pattern, n.logs())) for n in self.nodes.values())

    def cleanup(self) -> None:
        print(self.logs())  # shown by pytest only when the test failed
        for node in self.nodes.values():
            node.cleanup()
        self.pg.drop_db(self.db)
        shutil.rmtree(self.work, ignore_errors=True)


@pytest.fixture
def cluster(pg: ScratchPostgres, make_node: Any,
            request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(pg, make_node)
    try:
        yield c
    finally:
        c.cleanup()


def test_init_is_idempotent_and_bad_input_is_one_line(cluster: Cluster,
                                                      pg: ScratchPostgres) -> None:
    out = cluster.ok("cluster", "init")
    assert "version 1" in out and "3s" in out  # a re-init keeps the timeout it was given
    assert cluster.cli("cluster", "init", "--heartbeat-timeout", "0").returncode == 2
    cases = [
        ([*CLI, "--cluster", pg.dsn(), "nodes"], 1, "cluster init"),  # no schema there
        ([*CLI, "--cluster", "postgresql://x@/x?host=/nonexistent", "list"], 1, "cannot reach"),
        ([*CLI, "--cluster", "nonsense=1", "list"], 1, "bad cluster DSN"),
        ([*CLI, "nodes"], 2, "needs a cluster"),
        ([*CLI, "submit", "--no-requeue", "--", "true"], 2, "--no-requeue"),
        ([*CLI, "--cluster", cluster.dsn, "show", "99"], 1, "no job 99"),
        ([*CLI, "--cluster", cluster.dsn, "drain", "ghost"], 1, "no node 'ghost'"),
        ([*CLI, "--cluster", cluster.dsn, "top"], 2, "not available for a cluster"),
    ]
    queued = cluster.put("true")  # no agent: it stays queued
    cases.append(([*CLI, "--cluster", cluster.dsn, "inspect", str(queued)], 1, "on no node"))
    for argv, rc, text in cases:
        res = subprocess.run(argv, capture_output=True, text=True, cwd=cluster.work)
        assert res.returncode == rc, (argv, res.stderr)
        assert text in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


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
    res = subprocess.run([*CLI, "wait", str(ids[0])], capture_output=True, text=True,
                         env=dict(os.environ, TETHER_CLUSTER=cluster.dsn))  # the variable
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


def test_node_stopped_past_timeout_requeues_and_its_stale_run_is_killed(
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
    cluster.ok("resume", "n1")
    cluster.ok("resume", "n2")
    assert n0.agent is not None
    n0.agent.send_signal(signal.SIGSTOP)
    try:
        done = cluster.wait_job(again, lambda j: j["state"] == "completed", "attempt 2 done")
        assert (done["attempt"], done["exit_code"]) == (2, 0) and done["node"] in ("n1", "n2")
        failed = cluster.wait_job(once, lambda j: j["state"] == "failed", "failed")
        assert "--no-requeue" in failed["reason"]
        assert cluster.node("n0")["state"] == "down"
        stale = [p for j in first for p in j["pids"]]
        assert all(pid_alive(p) for p in stale)  # the stopped agent's jobs ran on meanwhile
    finally:
        n0.agent.send_signal(signal.SIGCONT)
    poll_until(lambda: not any(pid_alive(p) for p in stale), 15, "the stale runs to be killed")
    poll_until(lambda: cluster.node("n0")["state"] == "up", 15, "n0 to rejoin")
    assert cluster.job(again)["state"] == "completed" and cluster.job(again)["attempt"] == 2
    assert [(a["attempt"], a["node"], a["state"]) for a in cluster.attempts(again)] == \
        [(1, "n0", "lost"), (2, done["node"], "completed")]
    assert cluster.log_count(rf"cluster job {again} attempt \d: result delivered") == 1
    assert cluster.log_count(rf"cluster job {again} attempt 1\): .*discarding its result") == 1
    assert cluster.job(once)["state"] == "failed"


def test_results_finished_while_the_database_was_down_are_delivered_once(
        cluster: Cluster, pg: ScratchPostgres) -> None:
    nodes = cluster.agents("n0", "n1", "n2")
    ids = [cluster.put("sh", "-c", GATE) for _ in range(3)]
    for i in ids:
        cluster.wait_job(i, lambda j: j["state"] == "running", "running")
    pg.stop()
    stopped = time.monotonic()
    cluster.go()
    try:
        def all_local_done() -> bool:
            return all(j["state"] == "completed" for n in nodes
                       for j in json.loads(n.ok("list", "--json")))
        poll_until(all_local_done, 30, "every job to end on its node")
        # Down for longer than the timeout: at restart every heartbeat looks stale.
        time.sleep(max(0.0, stopped + TIMEOUT + 1 - time.monotonic()))
    finally:
        pg.start()
    for i in ids:
        job = cluster.wait_job(i, lambda j: j["state"] == "completed", "its result")
        assert job["attempt"] == 1
    # Nothing may be declared down once the agents have been back for a whole timeout.
    time.sleep(TIMEOUT + 1)
    assert [cluster.node(n)["state"] for n in ("n0", "n1", "n2")] == ["up"] * 3
    for i in ids:
        assert len(cluster.attempts(i)) == 1 and cluster.job(i)["attempt"] == 1
        assert cluster.log_count(rf"cluster job {i} attempt 1: result delivered") == 1
    assert cluster.log_count("refused") == 0


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
    nodes = cluster.agents("n0", "n1", cpus=4)
    conn = cluster_db.open_checked(cluster.dsn)
    try:
        with conn.transaction():  # one commit, one wake-up for both agents at once
            ids = [cluster_db.submit(conn, {
                "name": f"r{i}", "command": ["sh", "-c", f"echo {i} >> runs.log"],
                "cpus_per_task": 1, "ntasks": 1, "gpus_req": 0, "memory_mb": 0,
                "workdir": cluster.work, "env": {"PATH": os.environ["PATH"]},
                "submitted_at": rfc3339_now(), "pmi": "none", "username": "root", "uid": 0,
                "gid": 0, "requeue": True}, None, None)["id"] for i in range(20)]
    finally:
        conn.close()
    for i in ids:
        assert cluster.wait_job(i, lambda j: j["state"] == "completed", "done")["attempt"] == 1
        assert len(cluster.attempts(i)) == 1
    with open(os.path.join(cluster.work, "runs.log")) as f:
        assert sorted(f.read().split()) == sorted(str(i) for i in range(20))
    local = [len(json.loads(n.ok("list", "--json"))) for n in nodes]
    assert sum(local) == 20
