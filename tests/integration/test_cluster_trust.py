"""A cluster a site can trust (issue 24): each row of the attack table, tried for real.

Users never hold the database: they talk to their node's agent, which knows them from the kernel
(C1, C5). Secrets stay root's (C2, C3, C4, 6). Nodes are principals PostgreSQL itself confines
(C6, C7); a login that is neither a node nor the owner reaches nothing. A malformed row fails
alone (C8). Root's jobs follow the site's setting.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import stat
import subprocess
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests.clusterkit import GATE, Cluster, node_dsn
from tests.helpers import CLI, Node, pid_alive, poll_until
from tests.pgserver import ScratchPostgres
from tests.userkit import User, cli_as, made_users, shared

DENIED = "permission_denied"


@pytest.fixture
def users() -> Iterator[list[User]]:
    with made_users(2) as made:
        yield made


def one_line(res: subprocess.CompletedProcess[str]) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and len(lines) == 1, (res.returncode, res.stderr)
    return lines[0]


def test_users_submit_wait_and_cancel_their_own_jobs_and_nobody_elses(
        cluster: Cluster, users: list[User]) -> None:
    alice, bob = users
    n0, n1, login = cluster.agents("n0", "n1", "l0", login=("l0",))
    for n in (n0, n1, login):
        shared(n)
    env = {k: v for k, v in os.environ.items() if k.startswith(("PG", "TETHER_CLUSTER"))}
    assert not env  # nobody here holds a DSN

    def run(user: User, *args: str, node: Node = login) -> subprocess.CompletedProcess[str]:
        return cli_as(user, node, *args, cwd=cluster.work, umask=0o027)

    # each submits from the login node; the job is hers, by the kernel's word
    jobs = {}
    for user in (alice, bob):
        res = run(user, "submit", "--", "sh", "-c", GATE + "; id -u")
        assert res.returncode == 0, res.stderr + cluster.logs()
        jobs[user.name] = int(res.stdout)
    for user in (alice, bob):
        row = cluster.wait_job(jobs[user.name], lambda j: j["state"] == "running", "running")
        assert (row["uid"], row["gid"], row["username"], row["submit_node"]) == \
            (user.uid, user.gid, user.name, "l0")
        assert row["node"] in ("n0", "n1")  # never the login node
    mine = jobs[alice.name]
    # everyone lists everyone's jobs, with their nodes
    listing = run(bob, "list")
    assert listing.returncode == 0 and f"{alice.name}" in listing.stdout and "NODE" in \
        listing.stdout, listing.stderr
    # only the owner (or root) acts on a job: refused by the daemon that serves the request
    for args in (("cancel", str(mine)), ("hold", str(mine)), ("wait", str(mine)),
                 ("inspect", str(mine)), ("signal", str(mine), "TERM"),
                 ("attach", str(mine)), ("suspend", str(mine))):
        for node in (login, n0):
            res = run(bob, *args, node=node)
            assert "permission denied" in one_line(res), (args, res.stderr)
    assert "root only" in one_line(run(bob, "drain", "n0"))
    assert "only root may submit as another user" in one_line(
        run(bob, "submit", "--user", alice.name, "--", "true"))
    assert cluster.job(mine)["state"] == "running" and not cluster.job(mine)["held"]
    # the owner inspects it where it runs, and cancels it from any node
    where = cluster.nodes[cluster.job(mine)["node"]]
    res = run(alice, "inspect", str(mine), "--json", node=where)
    assert res.returncode == 0 and json.loads(res.stdout)["state"] == "running", res.stderr
    res = run(alice, "cancel", str(mine), node=n1 if where is n0 else n0)
    assert res.returncode == 0, res.stderr
    row = cluster.wait_job(mine, lambda j: j["state"] == "cancelled", "cancelled")
    assert row["cancelled_by"].startswith(f"uid {alice.uid} on node ")
    poll_until(lambda: not any(pid_alive(p) for p in row["pids"]), 15, "its task to die")
    # bob waits on his own to the end, from the login node; its output is his
    cluster.go()
    res = run(bob, "wait", str(jobs[bob.name]))
    assert res.returncode == 0, res.stderr
    out = cluster.job(jobs[bob.name])["output"]
    assert os.stat(out).st_uid == bob.uid
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o640  # his umask, carried by the cluster
    with open(out) as f:
        assert f.read().strip() == str(bob.uid)
    # root may act on anyone's job (from any node)
    held = int(run(alice, "submit", "--hold", "--", "true").stdout)
    assert cluster.job(held)["held"]
    assert cluster.cli("release", str(held), node="n1").returncode == 0
    assert cluster.wait_job(held, lambda j: j["state"] == "completed", "done")["uid"] == \
        alice.uid


def test_a_jobs_environment_is_its_submitters_alone(cluster: Cluster,
                                                    users: list[User]) -> None:
    alice, _ = users
    # the agents run with secrets in their own environment; none may reach a job
    for name in ("n0", "l0"):
        node = cluster.make_node(cpus=2)
        secret = os.path.join(node.dir, "cluster.dsn")
        cluster.add_node(name, secret)
        node.args += ["--node", name, "--heartbeat", "0.5"] + (["--login"] if name == "l0"
                                                               else [])
        cluster.nodes[name] = node
        with open(secret) as f:
            dsn = f.read().strip()
        # one through the file, one through its environment (TETHER_CLUSTER): both unseen
        extra = {"PGPASSWORD": "agent-secret", "TETHER_AGENT_SECRET": "agent-secret"}
        if name == "n0":
            node.args += ["--cluster-file", secret]
        else:
            extra["TETHER_CLUSTER"] = dsn
        node.start(env=extra, wait=False)
    for name in ("n0", "l0"):
        poll_until(cluster.nodes[name].agent_answers, 30, "the agent to answer")
        poll_until(lambda n=name: cluster.node(n)["state"] == "up", 30, f"{name} up")
        shared(cluster.nodes[name])
    # the agent given TETHER_CLUSTER keeps it from everything it starts
    login = cluster.nodes["l0"]
    for pid in [*login.template_pids(), *cluster.nodes["n0"].template_pids()]:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
        assert b"TETHER_CLUSTER" not in environ and b"postgresql" not in environ
    root_env = {"PGPASSWORD": "root-secret", "TETHER_CLUSTER": "postgresql://root@/x",
                "PGHOST": "/nowhere"}
    res = cluster.cli("submit", "--user", alice.name, "--", "env", node="l0", env=root_env)
    assert res.returncode == 0, res.stderr + cluster.logs()
    by_root = int(res.stdout)
    res = cli_as(alice, login, "submit", "--", "env", cwd=cluster.work)
    assert res.returncode == 0, res.stderr
    by_alice = int(res.stdout)
    for job in (by_root, by_alice):
        row = cluster.wait_job(job, lambda j: j["state"] == "completed", "done")
        assert row["uid"] == alice.uid
        with open(row["output"]) as f:
            names = {line.partition("=")[0] for line in f.read().splitlines()}
        leaked = {n for n in names if n.startswith("PG") or n in (
            "TETHER_CLUSTER", "TETHER_AGENT_SECRET")}
        assert not leaked, (job, leaked)


def test_root_never_sends_its_environment_to_an_agent_it_does_not_own(
        cluster: Cluster, users: list[User], tmp_path: Any) -> None:
    alice, _ = users
    fake = os.path.join(str(tmp_path), "fake")
    os.mkdir(fake)
    os.chmod(str(tmp_path), 0o755)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(os.path.join(fake, "agent.sock"))
        listener.listen(4)
        listener.setblocking(False)
        os.chown(fake, alice.uid, alice.gid)
        os.chown(os.path.join(fake, "agent.sock"), alice.uid, alice.gid)
        res = subprocess.run([*CLI, "submit", "--", "true"], capture_output=True, text=True,
                             env=dict(os.environ, TETHER_STATE_DIR=fake,
                                      PGPASSWORD="root-secret"), timeout=30)
        assert "root's environment goes only to an agent" in one_line(res)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody ever connected
    finally:
        listener.close()


def test_no_password_on_any_command_line_or_in_a_file_others_read(
        cluster: Cluster, make_node: Any, tmp_path: Any) -> None:
    cluster.agents("n0", "n1")
    passwords = [psycopg.conninfo.conninfo_to_dict(node_dsn(cluster, n))["password"]
                 for n in ("n0", "n1")]
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as f:
                text = f.read()
        except OSError:
            continue
        assert not any(str(p).encode() in text for p in passwords), cmdline
    for node in cluster.nodes.values():
        for root, _, files in os.walk(node.dir):
            for fname in files:
                path = os.path.join(root, fname)
                try:
                    st = os.lstat(path)
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError:
                    continue
                if any(str(p).encode() in data for p in passwords):
                    assert st.st_uid == 0 and not st.st_mode & 0o077, (path, oct(st.st_mode))
    # what a careless set-up would do is refused, in one line
    loose = os.path.join(str(tmp_path), "loose.dsn")
    with open(loose, "w") as f:
        f.write(node_dsn(cluster, "n0") + "\n")
    os.chmod(loose, 0o644)
    conf = os.path.join(str(tmp_path), "agent.toml")
    with open(conf, "w") as f:
        f.write(f'cluster = "{node_dsn(cluster, "n0")}"\n')
    os.chmod(conf, 0o644)
    state = os.path.join(str(tmp_path), "s")
    for argv, text in (
            (["--cluster-file", loose], "chmod 600"),
            (["--cluster", node_dsn(cluster, "n0")], "--cluster-file"),
            (["--config", conf], "cluster-file = PATH")):
        res = subprocess.run([*CLI, "agent", "--state-dir", state, "--node", "n0", *argv],
                             capture_output=True, text=True, timeout=30)
        assert text in one_line(res), res.stderr


def test_a_node_role_changes_only_its_own_rows_and_strangers_reach_nothing(
        cluster: Cluster, pg: ScratchPostgres) -> None:
    cluster.agents("n0", "n1")
    cluster.ok("drain", "n0")
    job = cluster.submit("sh", "-c", GATE)
    row = cluster.wait_job(job, lambda j: j["state"] == "running", "running on n1")
    assert row["node"] == "n1"
    with psycopg.connect(node_dsn(cluster, "n0"), autocommit=True) as conn:
        # straight SQL on the tables: PostgreSQL refuses it
        for statement in (
                f"UPDATE tether_jobs SET state = 'cancelled' WHERE id = {job}",
                f"UPDATE tether_jobs SET command = '[\"rm\"]' WHERE id = {job}",
                "UPDATE tether_nodes SET state = 'down' WHERE name = 'n1'",
                f"UPDATE tether_attempts SET state = 'lost' WHERE job = {job}",
                "DELETE FROM tether_jobs",
                "INSERT INTO tether_jobs (name, command, state, cpus_per_task, ntasks, "
                "gpus_req, memory_mb, output, error, workdir, env, submitted_at, uid, gid, "
                "username) VALUES ('x', '[\"id\"]', 'pending', 1, 1, 0, 0, '/o', '/o', '/', "
                "'{}', 'now', 0, 0, 'root')",
                "SELECT env FROM tether_jobs",
                "UPDATE tether_meta SET value = '0' WHERE key = 'heartbeat_timeout'"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)
        # its functions: only for its own attempts, never as another node
        refused = conn.execute("SELECT tether_report(%s, %s, %s)", (job, row["attempt"], Jsonb(
            {"state": "failed", "reason": "forged"}))).fetchone()
        assert refused is not None and "no longer current here" in refused[0]
        assert conn.execute("SELECT tether_set_running(%s, %s, 1, 'x', '[]', '[]', '[]', 1)",
                            (job, row["attempt"])).fetchone() == (False,)
        assert conn.execute("SELECT tether_requeue_unknown(%s, %s, 'forged')",
                            (job, row["attempt"])).fetchone() == (False,)
        assert conn.execute("SELECT tether_reap()").fetchone() == ([],)  # n1 beats on time
        with pytest.raises(psycopg.Error, match="this database login is node n0, not n1"):
            conn.execute("SELECT tether_register('n1', 'h', '/s', 1, 0, 0, 'v', 's', false)")
        with pytest.raises(psycopg.Error, match="not up"):
            conn.execute("SELECT tether_claim('not-its-session', 8, 0, 0)")
        assert conn.execute("SELECT count(*) FROM tether_jobs").fetchone() == (1,)  # reads
    after = cluster.job(job)
    assert (after["state"], after["node"], after["attempt"]) == ("running", "n1", 1)
    assert cluster.node("n1")["state"] == "up"
    # a login that is neither a node nor the owner reads and calls nothing of tether's
    stranger = cluster.db + "_stranger"
    cluster.roles.append(stranger)
    cluster.sql(f"CREATE ROLE {stranger} LOGIN PASSWORD 'pw'")
    dsn = psycopg.conninfo.make_conninfo(cluster.dsn, user=stranger, password="pw")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in ("SELECT * FROM tether_jobs", "SELECT id FROM tether_jobs",
                          "SELECT * FROM tether_nodes", "SELECT * FROM tether_meta",
                          "SELECT tether_me()", "SELECT tether_reap()",
                          "SELECT tether_submit('{}')",
                          f"SELECT tether_cancel({job}, 0)",
                          "SELECT nextval('tether_jobs_id_seq')"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)
    # nor can it run a node of its own (C6): its agent is refused and claims nothing
    cluster.go()
    cluster.wait_job(job, lambda j: j["state"] == "completed", "done")
    cluster.ok("drain", "n1")
    rogue = cluster.make_node(cpus=2)
    secret = os.path.join(rogue.dir, "cluster.dsn")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, dsn.encode())
    os.close(fd)
    rogue.args += ["--cluster-file", secret, "--node", "n0", "--heartbeat", "0.5"]
    rogue.start()
    waiting = cluster.put("true")
    poll_until(lambda: "it is no tether node" in rogue.logs(), 15, "the rogue agent refused")
    assert cluster.job(waiting)["state"] == "pending" and not cluster.local_jobs(rogue)


def test_root_jobs_follow_the_site_setting(cluster: Cluster) -> None:
    cluster.agents("n0")
    cluster.admin("init", "--root-jobs", "deny")
    res = cluster.cli("submit", "--", "true")
    assert "root jobs are disabled" in one_line(res)
    forged = cluster.put("id")  # written by the owner, uid 0: still never run
    row = cluster.wait_job(forged, lambda j: j["state"] == "failed", "failed")
    assert "root jobs are disabled" in row["reason"] and row["pids"] == []
    assert "root jobs denied" in cluster.admin("init").stdout  # a re-init keeps it
    cluster.admin("init", "--root-jobs", "allow")
    job = cluster.submit("true")
    assert cluster.wait_job(job, lambda j: j["state"] == "completed", "done")["uid"] == 0


def test_a_malformed_row_fails_alone(cluster: Cluster) -> None:
    bad_env = cluster.put("true", env=42)
    bad_command = cluster.put()
    cluster.sql("UPDATE tether_jobs SET command = '{}' WHERE id = %s", bad_command)
    cluster.agents("n0", "n1")
    for job, why in ((bad_env, "env must map"), (bad_command, "command must be")):
        row = cluster.wait_job(job, lambda j: j["state"] == "failed", "failed")
        assert why in row["reason"], row["reason"]
    later = [cluster.submit("true") for _ in range(3)]
    for job in later:
        assert cluster.wait_job(job, lambda j: j["state"] == "completed", "done")


def test_a_users_stopped_check_never_holds_up_the_clusters_requests(
        cluster: Cluster, users: list[User]) -> None:
    """A cluster submission's check as its user runs as on one node (agent/checks.py): on a
    thread of its own, bounded; a user who stops hers holds up no one else's requests."""
    import threading

    from tests.helpers import foreign_python
    from tests.integration.test_submit_checks import STOPPER, check_shells

    alice, bob = users
    (login,) = cluster.agents("l0", login=("l0",))
    cluster.agents("n0")
    shared(login)
    python, penv = foreign_python()
    stopper = subprocess.Popen([*python, "-c", STOPPER, "1", "60"], user=alice.uid,
                               group=alice.gid, extra_groups=[], cwd="/", text=True,
                               env=dict(penv, PATH="/usr/bin:/bin"), stdout=subprocess.PIPE)
    stop = threading.Event()

    def alice_submits() -> None:  # until one of her check shells is caught and stopped
        while not stop.is_set():
            cli_as(alice, login, "submit", "--hold", "--", "true", cwd=cluster.work)
    loops = [threading.Thread(target=alice_submits) for _ in range(3)]
    try:
        for t in loops:
            t.start()
        assert stopper.stdout is not None
        assert stopper.stdout.readline().startswith("stopped")
        res = cli_as(bob, login, "submit", "--", "true", cwd=cluster.work)
        assert res.returncode == 0, res.stderr
        assert cli_as(bob, login, "list").returncode == 0
        stopped = [p for p in check_shells(alice.uid) if _state(p) == "T"]
        assert stopped, "bob was answered only once alice's stopped check was killed"
        cluster.wait_job(int(res.stdout), lambda j: j["state"] == "completed", "bob's job")
    finally:
        stop.set()
        for t in loops:
            t.join(timeout=60)
        if stopper.poll() is None:
            stopper.kill()
        stopper.communicate()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return ""
