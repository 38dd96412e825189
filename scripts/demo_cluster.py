"""Demo: a throwaway PostgreSQL and three agents on this machine, set up as a site would.

The administrator (the tables' owner: here PostgreSQL's superuser ``postgres``, trusted on the
scratch server's Unix socket) runs ``tether cluster init`` and ``tether cluster add-node`` with
its connection string in ``TETHER_CLUSTER``; ``add-node`` creates each node's own database role
and writes that node's connection string (with its password) to a 0600 file. Each agent joins
with ``--cluster-file FILE --node NAME`` and logs in as its role, by password (the server's
pg_hba.conf trusts ``postgres`` alone). People never see a connection string: every command
below goes to a member agent's door (``TETHER_STATE_DIR``), which answers for the cluster.

Jobs spread over the nodes; one node is SIGSTOPped past the heartbeat timeout, its job is
requeued and completes elsewhere; on SIGCONT the node kills its stale run before rejoining.
Cleans up everything it started: agents, their supervisors and jobs, the database, the nodes'
roles and the server.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.common import kill_tree  # noqa: E402
from tests.pgserver import ScratchPostgres  # noqa: E402
from tether.shared.procid import proc_stat  # noqa: E402

TETHER = [sys.executable, "-m", "tether.cli.main"]
TIMEOUT = 3
HEARTBEAT = 0.5
DB = "tether_demo"
NODES = ("n1", "n2", "n3")
#: the group role ``cluster init`` creates for the database's nodes (``cluster_db.node_group``)
NODE_GROUP = ("tether_node_" + DB)[:63]


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def until(pred: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: timed out waiting for {what}")
        time.sleep(0.1)


def main() -> int:
    base = tempfile.mkdtemp(dir="/tmp", prefix="tether-cdemo.")  # 0700: the secrets live here
    work = os.path.join(base, "work")
    os.makedirs(work)
    # Nobody but the administrator's commands gets a connection string from the environment.
    clean = {k: v for k, v in os.environ.items() if k not in ("TETHER_CLUSTER",
                                                              "TETHER_STATE_DIR")}
    agents: dict[str, subprocess.Popen[bytes]] = {}
    stopped: set[str] = set()
    roles: list[str] = []
    say("a throwaway PostgreSQL (Debian's server, Unix socket only)")
    pg = ScratchPostgres()
    try:
        pg.start()
        admin_dsn = pg.create_db(DB)

        def run(args: list[str], env: dict[str, str], shown: str | None) -> str:
            if shown is not None:
                print(shown, flush=True)
            res = subprocess.run([*TETHER, *args], env=env, cwd=work, capture_output=True,
                                 text=True, timeout=120)
            if res.returncode:
                raise SystemExit(f"demo: tether {' '.join(args)} failed: {res.stderr}")
            if shown is not None and res.stdout:
                print(res.stdout, end="", flush=True)
            return res.stdout

        def admin(*args: str) -> str:
            """``tether cluster ...`` as the tables' owner, its DSN in its own environment."""
            return run(["cluster", *args], dict(clean, TETHER_CLUSTER=admin_dsn),
                       f"admin$ tether cluster {shlex.join(args)}")

        def via() -> str:
            """The node whose agent people's commands go to: any member that answers."""
            return next(n for n in NODES if n not in stopped)

        def tether(*args: str, show: bool = True) -> str:
            """A person's command, through a member agent's door (never the database)."""
            node = via()
            return run(list(args), dict(clean, TETHER_STATE_DIR=os.path.join(base, node)),
                       f"{node}$ tether {shlex.join(args)}" if show else None)

        def job(i: int) -> dict[str, object]:
            result: dict[str, object] = json.loads(tether("show", str(i), "--json", show=False))
            return result

        def states() -> list[str]:
            return [str(n["state"]) for n in json.loads(tether("nodes", "--json", show=False))]

        say(f"the administrator sets up database {DB!r} (as postgres, the tables' owner)")
        print(f"admin$ export TETHER_CLUSTER='{admin_dsn}'")
        # The demo's jobs run as root, which a cluster refuses unless told otherwise.
        admin("init", "--heartbeat-timeout", str(TIMEOUT), "--root-jobs", "allow")
        for name in NODES:
            roles.append(f"{DB}_{name}")  # roles are the server's: named per database
            admin("add-node", name, "--role", f"{DB}_{name}", "--write",
                  os.path.join(base, f"{name}.dsn"))

        say(f"three agents join: {', '.join(NODES)} (2 CPUs each, heartbeat {HEARTBEAT:g} s), "
            "each logging in as its own role")
        for name in NODES:
            argv = ["agent", "--state-dir", os.path.join(base, name), "--cluster-file",
                    os.path.join(base, f"{name}.dsn"), "--node", name, "--heartbeat",
                    str(HEARTBEAT), "--cpus", "2", "--oversubscribe", "--cancel-grace", "1"]
            print(f"{name}# tether {shlex.join(argv)}", flush=True)
            with open(os.path.join(base, f"{name}.log"), "wb") as out:
                agents[name] = subprocess.Popen(
                    [*TETHER, *argv], env=clean, stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True)

        def joined() -> bool:
            for name, proc in agents.items():
                if proc.poll() is not None:
                    with open(os.path.join(base, f"{name}.log")) as f:
                        raise SystemExit(f"demo: the agent of {name} exited with "
                                         f"{proc.returncode}:\n{f.read()[-3000:]}")
            try:
                return states() == ["up"] * len(NODES)
            except SystemExit:
                return False  # an agent not answering yet
        until(joined, 30, "three nodes up")
        print(f"(people's commands: TETHER_STATE_DIR={os.path.join(base, via())}, shown as "
              f"\"{via()}$\": that agent answers for the whole cluster)")
        tether("nodes")

        say("six jobs, submitted through n1's agent and spread over the nodes")
        ids = [tether("submit", "--", "sh", "-c", "sleep 1; echo done", show=False).strip()
               for _ in range(6)]
        for i in ids:
            tether("wait", i, show=False)
        tether("list")

        say(f"a long job; its node is SIGSTOPped for longer than the {TIMEOUT}s timeout")
        long_id = tether("submit", "--", "sh", "-c",
                         "test -e marker && echo attempt 2 ends at once && exit 0; "
                         "touch marker; exec sleep 600").strip()
        until(lambda: job(int(long_id))["state"] == "running" and job(int(long_id))["pids"],
              30, "the long job to run")
        first = job(int(long_id))
        node = str(first["node"])
        stale = [int(p) for p in first["pids"]]  # type: ignore[attr-defined]
        print(f"job {long_id} runs on {node} (task pid {stale}); kill -STOP its agent")
        people = via()
        agents[node].send_signal(signal.SIGSTOP)
        stopped.add(node)
        if via() != people:  # a stopped agent answers nobody: any other member will do
            print(f"(people's commands now go to {via()}'s agent: {node}'s answers nobody)")
        until(lambda: job(int(long_id))["state"] == "completed", 60, "attempt 2 to complete")
        tether("nodes")
        done = job(int(long_id))
        print(f"job {long_id}: requeued when {node} was declared down; attempt "
              f"{done['attempt']} completed on {done['node']}")
        st = proc_stat(stale[0])
        print(f"the attempt-1 task (pid {stale[0]}) still runs on the stopped node: "
              f"{st is not None and not st.dead}")

        say(f"kill -CONT the agent of {node}: it reconciles before taking work")
        agents[node].send_signal(signal.SIGCONT)
        stopped.discard(node)
        until(lambda: (st := proc_stat(stale[0])) is None or st.dead, 30,
              "the stale run to be killed")
        print(f"the stale attempt-1 task (pid {stale[0]}) was killed; its result discarded")
        until(lambda: all(s == "up" for s in states()), 30, f"{node} to rejoin")
        tether("nodes")
        tether("show", long_id)
        with open(os.path.join(base, f"{node}.log")) as f:
            print("".join(line for line in f if "cluster" in line or "stale" in line
                          or "no longer" in line)[-1500:])
    finally:
        say("stopping everything")
        try:
            for proc in agents.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
            kill_tree(base)
            # the database first (its objects name the roles), then the roles: a server's own
            pg.drop_db(DB)
            pg.drop_roles(*roles, NODE_GROUP)
        finally:
            pg.cleanup()
            shutil.rmtree(base, ignore_errors=True)
    print("done: the database, the nodes' roles, the agents, their supervisors and jobs are "
          "gone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
