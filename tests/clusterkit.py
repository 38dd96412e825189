"""A cluster for tests: a real PostgreSQL (Debian's, started once per module), a fresh database
per test, and agents on this machine, each its own node with its own database role.

Set up as docs/cluster.md tells a site: ``tether cluster init`` and ``tether cluster add-node``
run as the administrator (here PostgreSQL's superuser, by trust on the Unix socket); each node's
agent gets its connection string in a root-only file (``--cluster-file``) and logs in with its
password (scram-sha-256: the server's pg_hba.conf asks every other role for one). People talk to
their node's agent only (``Cluster.cli``). Roles are named per database (roles are the server's)
and dropped with it, whatever the test did.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from tests.helpers import CLI, Node, poll_until
from tests.pgserver import ScratchPostgres
from tether.shared.cluster_sql import node_state

HEARTBEAT = "0.5"
TIMEOUT = 3.0
#: a lost node's jobs run elsewhere TIMEOUT + MARGIN after its last heartbeat
MARGIN = 1.5
#: a job that holds its CPUs until the test opens the gate (Cluster.go)
GATE = "while [ ! -e go ]; do sleep 0.05; done"


def have_postgres() -> bool:
    return any(os.path.exists(f"/usr/lib/postgresql/{v}/bin/postgres") for v in range(12, 30))


@pytest.fixture(scope="module")
def pg() -> Iterator[ScratchPostgres]:
    if not have_postgres():
        pytest.fail("PostgreSQL server not installed (scripts/setup.sh --tests installs it)")
    server = ScratchPostgres()
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


class Cluster:
    def __init__(self, pg: ScratchPostgres, make_node: Any, root_jobs: str = "allow",
                 init: bool = True) -> None:
        self.pg = pg
        self.make_node = make_node
        self.db = "t" + uuid.uuid4().hex[:10]
        self.dsn = pg.create_db(self.db)  # the administrator's
        self.work = tempfile.mkdtemp(dir="/tmp", prefix="ttw")
        os.chmod(self.work, 0o777)  # every test user writes its outputs here
        self.nodes: dict[str, Node] = {}
        self.roles: list[str] = []
        if init:  # else the test builds the schema itself (an upgrade)
            self.admin("init", "--heartbeat-timeout", str(TIMEOUT), "--fence-margin",
                       str(MARGIN), "--root-jobs", root_jobs)

    # ---- the administrator -----------------------------------------------------------------

    def admin(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``tether cluster ...`` as the database's owner (its DSN in its own environment)."""
        res = subprocess.run([*CLI, "cluster", *args], capture_output=True, text=True,
                             cwd=self.work, timeout=60,
                             env=dict(os.environ, TETHER_CLUSTER=self.dsn))
        if check:
            assert res.returncode == 0, f"tether cluster {' '.join(args)}: {res.stderr}"
        return res

    def role(self, name: str) -> str:
        return f"{self.db}_{name}"

    def add_node(self, name: str, path: str) -> None:
        """Give node ``name`` its role; its connection string goes to ``path`` (0600)."""
        self.roles.append(self.role(name))
        self.admin("add-node", name, "--role", self.role(name), "--write", path)

    def agents(self, *names: str, cpus: int = 2, login: tuple[str, ...] = (),
               env: dict[str, dict[str, str]] | None = None) -> list[Node]:
        made = []
        for name in names:
            node = self.make_node(cpus=cpus)
            secret = os.path.join(node.dir, "cluster.dsn")
            self.add_node(name, secret)
            node.args += ["--cluster-file", secret, "--node", name, "--heartbeat", HEARTBEAT]
            if name in login:
                node.args.append("--login")
            self.nodes[name] = node
            node.start(env=(env or {}).get(name), wait=False)
            made.append(node)
        for node in made:
            poll_until(node.agent_answers, 30, "the agent to answer `status`")
        for name in names:
            poll_until(lambda n=name: self.node(n)["state"] == "up", 30, f"node {name} up")
        return made

    # ---- people, through a node's agent ----------------------------------------------------

    def cli(self, *args: str, node: str | None = None, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        at = self.nodes[node or next(iter(self.nodes))]
        return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=self.work,
                              timeout=timeout, env=dict(os.environ, TETHER_STATE_DIR=at.state,
                                                        **(env or {})))

    def ok(self, *args: str, node: str | None = None) -> str:
        res = self.cli(*args, node=node)
        assert res.returncode == 0, f"tether {' '.join(args)}: rc={res.returncode} " \
                                    f"{res.stderr}\n{self.logs()}"
        return res.stdout

    def submit(self, *command: str, opts: tuple[str, ...] = (), node: str | None = None) -> int:
        """Through the CLI (what people do)."""
        return int(self.ok("submit", *opts, "--", *command, node=node).strip())

    # ---- the database, as its owner ----------------------------------------------------------

    def sql(self, query: str, *params: Any) -> list[dict[str, Any]]:
        with psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row) as conn:
            cur = conn.execute(query, params or None)
            return cur.fetchall() if cur.description else []

    def put(self, *command: str, requeue: bool = True, uid: int = 0, user: str = "root",
            env: Any = None, gid: int | None = None) -> int:
        """A row straight into the table, as the owner may (fast: no interpreter start)."""
        out = f"{self.work}/tether-"
        rows = self.sql(  # one statement: a claim never sees the row half written
            "WITH n AS (SELECT nextval('tether_jobs_id_seq') AS id) "
            "INSERT INTO tether_jobs (id, name, command, state, cpus_per_task, ntasks, gpus_req, "
            "memory_mb, output, error, workdir, env, submitted_at, pmi, username, uid, gid, "
            "requeue) SELECT n.id, %s, %s, 'pending', 1, 1, 0, 0, %s || n.id || '.out', "
            "%s || n.id || '.out', %s, %s, '2026-01-01T00:00:00.000Z', 'none', %s, %s, %s, %s "
            "FROM n RETURNING id",
            command[0] if command else "x", Jsonb(list(command)), out, out, self.work,
            Jsonb({"PATH": os.environ["PATH"]} if env is None else env), user, uid,
            uid if gid is None else gid, requeue)
        job = int(rows[0]["id"])
        self.sql("SELECT pg_notify('tether_queue', '')")
        return job

    def go(self) -> None:
        """Open the gate of every job running GATE."""
        open(os.path.join(self.work, "go"), "w").close()

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

    def local_jobs(self, node: str | Node) -> list[dict[str, Any]]:
        """What a node ran, from its own store (its CLI lists the cluster's jobs)."""
        import sqlite3

        at = self.nodes[node] if isinstance(node, str) else node
        if not os.path.exists(at.layout.db):
            return []
        conn = sqlite3.connect(f"file:{at.layout.db}?mode=ro", uri=True)
        try:
            rows = conn.execute("SELECT id, state FROM jobs").fetchall()
        finally:
            conn.close()
        return [{"id": r[0], "state": r[1]} for r in rows]

    def logs(self) -> str:
        return "\n".join(f"=== node {name}\n{n.logs()}" for name, n in self.nodes.items())

    def log_count(self, pattern: str) -> int:
        return sum(len(re.findall(pattern, n.logs())) for n in self.nodes.values())

    def cleanup(self) -> None:
        print(self.logs())  # shown by pytest only when the test failed
        try:
            for node in self.nodes.values():
                node.cleanup()
        finally:
            self.pg.drop_db(self.db)
            self.pg.drop_roles(*self.roles, ("tether_node_" + self.db)[:63])
            shutil.rmtree(self.work, ignore_errors=True)


@pytest.fixture
def cluster(pg: ScratchPostgres, make_node: Any) -> Iterator[Cluster]:
    c = Cluster(pg, make_node)
    try:
        yield c
    finally:
        c.cleanup()


def node_dsn(cluster: Cluster, name: str) -> str:
    """The connection string node ``name`` was given (read as root, as its agent does)."""
    with open(os.path.join(cluster.nodes[name].dir, "cluster.dsn")) as f:
        return f.read().strip()


def as_json(text: str) -> Any:
    return json.loads(text)
