"""Figures for many nodes on PostgreSQL, each beside a reference measured in the same run.

    .venv/bin/python bench/cluster_bench.py [--samples 15] [--jobs 60] [--sleep-jobs 96]
                                            [--failovers 3] [--json]

Set up as a site would (docs/cluster.md): the administrator (PostgreSQL's superuser ``postgres``,
the tables' owner, trusted on the scratch server's Unix socket) runs ``tether cluster init
--root-jobs allow`` (the bench's jobs are root's) and ``tether cluster add-node`` per node, with
its connection string in ``TETHER_CLUSTER``; each agent joins with ``--cluster-file`` and logs in
as its own role, by password. Jobs are submitted as people do, through a member agent's door (the
CLI's client, one connection kept open, as for the reference); the figures are read from the
database as its owner (LISTEN ``tether_job``, the rows' own stamps), which submits nothing.

The cluster is measured twice, side by side: first with node n0's agent alone, then with n1 and
n2 joined (three agents, one database).

1. Submit -> completed through the cluster, ``true``, sequential, median: ``submit`` to node n0's
   agent, then LISTEN until the job's result is recorded in the database; with one agent and
   with three. Reference: the same through a standalone agent's socket (submit, then a
   long-polling wait).
2. ``tether submit --wait -- true`` as a person types it (the CLI started each time, its
   ``TETHER_STATE_DIR`` n0's), sequential, median, with one agent and with three. Reference: the
   same command against the standalone agent, in the same run (goal: cluster <= 1.5x).
3. Jobs/s: ``--jobs`` ``true`` jobs, and ``--sleep-jobs`` ``sleep 1`` jobs, submitted one after
   another through n0's agent, from the first submit to the last result recorded; with one
   agent and with three (goal for ``sleep 1``: three agents >= 2.5x one). Reference for ``true``:
   the same jobs through one standalone agent.
4. Heartbeat timeout -> the job running elsewhere: a node running a job is SIGSTOPped; from the
   moment its last heartbeat became older than the timeout to the start of attempt 2 on another
   node (the supervisor's own ``started_at``), ``--failovers`` times. Then SIGCONT: the time
   until the node's stale attempt-1 task is dead.

A throwaway PostgreSQL (tests/pgserver.py) with a database of its own, three agents (4 CPUs each,
heartbeat 0.5 s, timeout 2 s) and a standalone agent, all on short temporary directories;
everything is killed and removed on the way out (the database, then the nodes' roles, then the
server), whatever failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import ScratchAgent, kill_tree  # noqa: E402
from tests.pgserver import ScratchPostgres  # noqa: E402
from tether.shared import cluster_db, stamps  # noqa: E402
from tether.shared.client import Client  # noqa: E402
from tether.shared.cluster_sql import CHANNEL_JOB, DEFAULT_FENCE_MARGIN, FINAL  # noqa: E402
from tether.shared.paths import Layout  # noqa: E402
from tether.shared.procid import proc_stat  # noqa: E402

TETHER = [sys.executable, "-m", "tether.cli.main"]
HEARTBEAT, TIMEOUT = 0.5, 2.0
DB = "tether_bench"
NODES = ["n0", "n1", "n2"]


def log(msg: str) -> None:
    print(f"[cluster_bench] {msg}", file=sys.stderr, flush=True)


def epoch(text: str) -> float:
    value = stamps.epoch(text)
    assert value is not None, f"not an RFC 3339 stamp: {text!r}"
    return value


def submission(command: list[str], work: str) -> dict[str, Any]:
    """The arguments of ``submit`` as the CLI sends them (cli/cmd_submit.py)."""
    return {"command": command, "cpus": 1, "gpus": 0, "memory_mb": 0, "ntasks": 1,
            "workdir": work, "env": {"PATH": os.environ["PATH"]}, "pmi": "none",
            "umask": 0o022}


class Bench:
    def __init__(self, base: str, pg: ScratchPostgres) -> None:
        self.base = base
        self.pg = pg
        self.work = os.path.join(base, "w")
        os.makedirs(self.work)
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.roles: list[str] = []
        self.client: Client | None = None
        self.conn: cluster_db.Conn | None = None
        self.dsn = pg.create_db(DB)  # the administrator's: the tables' owner
        try:
            self.admin("init", "--heartbeat-timeout", str(TIMEOUT), "--root-jobs", "allow")
            # The measurements' own connection, as the owner: it reads, it never submits.
            self.conn = cluster_db.open_checked(self.dsn)
            cluster_db.listen(self.conn, CHANNEL_JOB)
        except BaseException:
            self.close()
            raise

    @property
    def owner(self) -> cluster_db.Conn:
        """The measurements' connection, as the tables' owner."""
        assert self.conn is not None
        return self.conn

    def admin(self, *args: str) -> None:
        """``tether cluster ...`` as the tables' owner, its DSN in its own environment."""
        res = subprocess.run([*TETHER, "cluster", *args], capture_output=True, text=True,
                             env=dict(os.environ, TETHER_CLUSTER=self.dsn), timeout=60)
        if res.returncode:
            raise SystemExit(f"tether cluster {' '.join(args)}: {res.stderr.strip()}")

    def state(self, name: str) -> str:
        return os.path.join(self.base, name)

    def start_agents(self, names: list[str]) -> None:
        """Start (more) agents; wait until every agent started so far is up."""
        for name in names:
            secret = os.path.join(self.base, f"{name}.dsn")
            self.roles.append(f"{DB}_{name}")  # roles are the server's: named per database
            self.admin("add-node", name, "--role", f"{DB}_{name}", "--write", secret)
            with open(os.path.join(self.base, f"{name}.log"), "ab") as out:
                self.agents[name] = subprocess.Popen(
                    [*TETHER, "agent", "--state-dir", self.state(name), "--cluster-file",
                     secret, "--node", name, "--heartbeat", str(HEARTBEAT), "--cpus", "4",
                     "--oversubscribe", "--cancel-grace", "1"], stdout=out,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while {n["name"] for n in cluster_db.list_nodes(self.owner)
               if n["state"] == "up"} != set(self.agents):
            for name, proc in self.agents.items():
                if proc.poll() is not None:
                    raise SystemExit(f"the agent of {name} exited with {proc.returncode} "
                                     f"(see {self.base}/{name}.log)")
            if time.monotonic() > deadline:
                raise SystemExit("the agents did not join")
            time.sleep(0.05)
        # People's door: n0's agent, through the client the CLI uses (kept open, as for the
        # standalone reference).
        if self.client is None:
            self.client = Client(Layout(self.state(names[0])).sock, timeout=30)
            self.client.connect()

    def submit(self, command: list[str]) -> int:
        assert self.client is not None
        return int(self.client.call("submit", submission(command, self.work))["id"])

    def until_final(self, ids: set[int], timeout: float = 120) -> None:
        left = set(ids)
        deadline = time.monotonic() + timeout
        while left:
            rows = self.owner.execute("SELECT id FROM tether_jobs WHERE id = ANY(%s) AND state "
                                     "= ANY(%s)", (list(left), list(FINAL))).fetchall()
            left -= {r["id"] for r in rows}
            if not left:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"jobs {sorted(left)[:5]} did not end")
            for _ in self.owner.notifies(timeout=1.0, stop_after=1):
                pass

    def latency(self, samples: int) -> list[float]:
        out = []
        for i in range(samples + 2):
            t = time.perf_counter()
            job = self.submit(["true"])
            self.until_final({job})
            if i >= 2:  # two warm-ups
                out.append((time.perf_counter() - t) * 1000)
        return out

    def throughput(self, jobs: int, command: tuple[str, ...] = ("true",)) -> float:
        t = time.perf_counter()
        ids = {self.submit(list(command)) for _ in range(jobs)}
        self.until_final(ids, timeout=max(120.0, jobs * 2.0))
        return jobs / (time.perf_counter() - t)

    def failover(self) -> tuple[float, float]:
        """(heartbeat timeout -> attempt 2 running elsewhere, SIGCONT -> attempt 1 killed)."""
        marker = os.path.join(self.work, f"m{time.monotonic_ns()}")
        job = self.submit(["sh", "-c", f"test -e {marker} && exit 0; touch {marker}; sleep 60"])
        deadline = time.monotonic() + 30
        while (row := cluster_db.get_job(self.owner, job))["state"] != "running" \
                or not row["pids"]:
            if time.monotonic() > deadline:
                raise SystemExit("the failover job did not start")
            time.sleep(0.02)
        stale = row["pids"][0]
        victim = self.agents[row["node"]]
        victim.send_signal(signal.SIGSTOP)
        try:
            self.until_final({job}, timeout=60)
            hb = self.owner.execute(
                "SELECT extract(epoch FROM heartbeat) AS hb FROM tether_nodes WHERE name = %s",
                (row["node"],)).fetchone()
            assert hb is not None, f"node {row['node']} vanished"
            done = cluster_db.get_job(self.owner, job)
            assert done["attempt"] == 2 and done["node"] != row["node"], done
            moved = epoch(done["started_at"]) - (float(hb["hb"]) + TIMEOUT)
        finally:
            victim.send_signal(signal.SIGCONT)
            resumed = time.perf_counter()
        while (st := proc_stat(stale)) is not None and not st.dead:
            if time.perf_counter() - resumed > 30:
                raise SystemExit("the stale run was not killed")
            time.sleep(0.005)
        killed = time.perf_counter() - resumed
        deadline = time.monotonic() + 30
        while any(n["state"] != "up" for n in cluster_db.list_nodes(self.owner)):
            if time.monotonic() > deadline:
                raise SystemExit(f"node {row['node']} did not rejoin")
            time.sleep(0.05)
        return moved, killed

    def close(self) -> None:
        """Everything, whatever failed: the agents and their jobs, then the database, then the
        nodes' roles (a server's own: they outlive a dropped database)."""
        try:
            if self.client is not None:
                self.client.close()
            if self.conn is not None:
                self.conn.close()
            for proc in self.agents.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
            kill_tree(self.base)
        finally:
            self.pg.drop_db(DB)
            self.pg.drop_roles(*self.roles, ("tether_node_" + DB)[:63])


def cli_latency(state: str, work: str, samples: int) -> list[float]:
    """``tether submit --wait -- true`` as a person runs it on a node whose agent serves
    ``state``: the CLI started each time, sequential (two warm-ups), in milliseconds."""
    env = dict(os.environ, TETHER_STATE_DIR=state)
    out = []
    for i in range(samples + 2):
        t = time.perf_counter()
        res = subprocess.run([*TETHER, "submit", "--wait", "--", "true"], env=env, cwd=work,
                             capture_output=True, text=True, timeout=120)
        if res.returncode:
            raise SystemExit(f"tether submit --wait -- true: rc {res.returncode}: "
                             f"{res.stderr.strip()}")
        if i >= 2:
            out.append((time.perf_counter() - t) * 1000)
    return out


def standalone(samples: int, jobs: int) -> tuple[list[float], float, list[float]]:
    agent = ScratchAgent("tcb", 12)
    try:
        with Client(os.path.join(agent.state, "agent.sock"), timeout=30) as c:
            def run(ids: list[int]) -> None:
                for job in ids:
                    while not c.call("wait", {"job": job, "hold": 20}, timeout=30)["done"]:
                        pass

            def sub() -> int:
                return int(c.call("submit", {"command": ["true"], "workdir": agent.work,
                                             "env": {"PATH": os.environ["PATH"]}})["id"])
            lat = []
            for i in range(samples + 2):
                t = time.perf_counter()
                run([sub()])
                if i >= 2:
                    lat.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            ids = [sub() for _ in range(jobs)]
            run(ids)
            rate = jobs / (time.perf_counter() - t)
        return lat, rate, cli_latency(agent.state, agent.work, samples)
    finally:
        agent.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--jobs", type=int, default=60)
    ap.add_argument("--sleep-jobs", type=int, default=96,
                    help="`sleep 1` jobs for jobs/s with one agent and with three")
    ap.add_argument("--failovers", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    # Only the administrator's commands get a connection string (Bench.admin); a stray one
    # would make the standalone reference agent a cluster's member.
    for var in ("TETHER_CLUSTER", "TETHER_STATE_DIR"):
        os.environ.pop(var, None)
    base = tempfile.mkdtemp(dir="/tmp", prefix="tcb")
    pg = ScratchPostgres()
    bench: Bench | None = None
    try:
        pg.start()
        bench = Bench(base, pg)
        bench.start_agents(NODES[:1])
        log("one agent: latency, submit --wait, jobs/s (true, then sleep 1)")
        lat1 = bench.latency(ns.samples)
        cli1 = cli_latency(bench.state(NODES[0]), bench.work, ns.samples)
        rate1 = bench.throughput(ns.jobs)
        sleep1 = bench.throughput(ns.sleep_jobs, ("sleep", "1"))
        bench.start_agents(NODES[1:])
        log("three agents: latency, submit --wait, jobs/s (true, then sleep 1)")
        lat = bench.latency(ns.samples)
        cli3 = cli_latency(bench.state(NODES[0]), bench.work, ns.samples)
        rate = bench.throughput(ns.jobs)
        sleep3 = bench.throughput(ns.sleep_jobs, ("sleep", "1"))
        log("failover")
        fails = [bench.failover() for _ in range(ns.failovers)]
        fail = [f[0] for f in fails]
        kills = [f[1] for f in fails]
        bench.close()
        bench = None
        log("reference: one standalone agent")
        ref_lat, ref_rate, ref_cli = standalone(ns.samples, ns.jobs)
    finally:
        if bench is not None:
            bench.close()
        pg.cleanup()
        subprocess.run(["rm", "-rf", base], check=False)
    def spread(ms: list[float]) -> dict[str, Any]:
        return {"median": round(statistics.median(ms), 1), "min": round(min(ms), 1),
                "max": round(max(ms), 1), "n": len(ms)}

    res: dict[str, Any] = {
        "cluster_submit_to_completed_ms": spread(lat),
        "cluster_submit_to_completed_ms_1_agent": spread(lat1),
        "standalone_submit_to_completed_ms": {"median": round(statistics.median(ref_lat), 1),
                                              "n": len(ref_lat)},
        "cluster_cli_submit_wait_ms_3_agents": spread(cli3),
        "cluster_cli_submit_wait_ms_1_agent": spread(cli1),
        "standalone_cli_submit_wait_ms": spread(ref_cli),
        "cluster_jobs_per_s_3_agents": round(rate, 1),
        "cluster_jobs_per_s_1_agent": round(rate1, 1),
        "standalone_jobs_per_s_1_agent": round(ref_rate, 1),
        "cluster_sleep1_jobs_per_s_3_agents": round(sleep3, 2),
        "cluster_sleep1_jobs_per_s_1_agent": round(sleep1, 2),
        "sleep1_speedup_3_over_1": round(sleep3 / sleep1, 2),
        "cli_submit_wait_ratio_cluster_3_over_standalone": round(
            statistics.median(cli3) / statistics.median(ref_cli), 2),
        "timeout_to_running_elsewhere_s": [round(f, 2) for f in fail],
        "sigcont_to_stale_run_killed_s": [round(k, 2) for k in kills],
        "heartbeat_s": HEARTBEAT, "timeout_s": TIMEOUT,
    }
    if ns.json:
        print(json.dumps(res))
        return 0
    c, s = res["cluster_submit_to_completed_ms"], res["standalone_submit_to_completed_ms"]
    c1 = res["cluster_submit_to_completed_ms_1_agent"]
    print(f"submit -> completed (true), median: cluster, three agents {c['median']} ms "
          f"(min {c['min']}, max {c['max']}, n={c['n']}); one agent {c1['median']} ms "
          f"(min {c1['min']}, max {c1['max']}); standalone agent {s['median']} ms; "
          f"ratio (three) {c['median'] / s['median']:.2f}")
    w3, w1 = res["cluster_cli_submit_wait_ms_3_agents"], res["cluster_cli_submit_wait_ms_1_agent"]
    ws = res["standalone_cli_submit_wait_ms"]
    ratio = res["cli_submit_wait_ratio_cluster_3_over_standalone"]
    print(f"tether submit --wait -- true (the CLI each time), median: cluster, three agents "
          f"{w3['median']} ms, one agent {w1['median']} ms; standalone agent {ws['median']} ms; "
          f"ratio (three) {ratio:.2f} (goal <= 1.5: {'met' if ratio <= 1.5 else 'NOT met'})")
    print(f"jobs/s ({ns.jobs} x true): three agents {res['cluster_jobs_per_s_3_agents']}; one "
          f"agent {res['cluster_jobs_per_s_1_agent']}; one standalone agent "
          f"{res['standalone_jobs_per_s_1_agent']}")
    up = res["sleep1_speedup_3_over_1"]
    print(f"jobs/s ({ns.sleep_jobs} x sleep 1, 4 CPUs per agent): three agents "
          f"{res['cluster_sleep1_jobs_per_s_3_agents']}; one agent "
          f"{res['cluster_sleep1_jobs_per_s_1_agent']}; {up:.2f}x (goal >= 2.5x: "
          f"{'met' if up >= 2.5 else 'NOT met'})")
    print(f"heartbeat timeout ({TIMEOUT:g}s, heartbeat {HEARTBEAT:g}s, then the fence margin, "
          f"{DEFAULT_FENCE_MARGIN:g}s by default) -> running elsewhere: "
          f"{', '.join(f'{f:.2f}' for f in fail)} s")
    print(f"SIGCONT of the stopped node -> its stale attempt-1 task dead: "
          f"{', '.join(f'{k:.2f}' for k in kills)} s (0: its step fenced itself at the "
          "timeout; else SIGTERM, --cancel-grace 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
