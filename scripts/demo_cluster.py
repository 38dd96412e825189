"""Demo: a throwaway PostgreSQL and three agents on this machine. Jobs spread over the nodes; one
node is SIGSTOPped past the heartbeat timeout, its job is requeued and completes elsewhere; on
SIGCONT the node kills its stale run before rejoining. Cleans up everything it started."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.common import kill_tree  # noqa: E402
from tests.pgserver import ScratchPostgres  # noqa: E402
from tether.shared.procid import proc_stat  # noqa: E402

TETHER = [sys.executable, "-m", "tether.cli.main"]
TIMEOUT = 3


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def until(pred: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: timed out waiting for {what}")
        time.sleep(0.1)


def main() -> int:
    base = tempfile.mkdtemp(dir="/tmp", prefix="tether-cdemo.")
    work = os.path.join(base, "work")
    os.makedirs(work)
    agents: dict[str, subprocess.Popen[bytes]] = {}
    say("a throwaway PostgreSQL (Debian's server, Unix socket only)")
    pg = ScratchPostgres()
    try:
        pg.start()
        dsn = pg.dsn()
        env = dict(os.environ, TETHER_CLUSTER=dsn)

        def tether(*args: str, show: bool = True) -> str:
            if show:
                print(f"$ tether {' '.join(args)}", flush=True)
            res = subprocess.run([*TETHER, *args], env=env, cwd=work, capture_output=True,
                                 text=True)
            if res.returncode:
                raise SystemExit(f"demo: tether {' '.join(args)} failed: {res.stderr}")
            if show and res.stdout:
                print(res.stdout, end="", flush=True)
            return res.stdout

        def job(i: int) -> dict[str, object]:
            result: dict[str, object] = json.loads(tether("show", str(i), "--json", show=False))
            return result

        tether("cluster", "init", "--heartbeat-timeout", str(TIMEOUT))
        say("three agents join: n1, n2, n3 (2 CPUs each, heartbeat 0.5 s)")
        for name in ("n1", "n2", "n3"):
            with open(os.path.join(base, f"{name}.log"), "wb") as out:
                agents[name] = subprocess.Popen(
                    [*TETHER, "agent", "--state-dir", os.path.join(base, name), "--cpus", "2",
                     "--oversubscribe", "--node", name, "--heartbeat", "0.5", "--cancel-grace",
                     "1"], env=env,
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        until(lambda: [n["state"] for n in json.loads(tether("nodes", "--json", show=False))]
              == ["up"] * 3, 30, "three nodes up")
        tether("nodes")

        say("six jobs, spread over the nodes")
        ids = [tether("submit", "--", "sh", "-c", "sleep 1; echo done", show=False).strip()
               for _ in range(6)]
        for i in ids:
            tether("wait", i, show=False)
        tether("list")

        say(f"a long job; its node is SIGSTOPped for longer than the {TIMEOUT}s timeout")
        long_id = tether("submit", "--", "sh", "-c",
                         "test -e marker && echo attempt 2 ends at once && exit 0; "
                         "touch marker; exec sleep 600").strip()
        until(lambda: job(int(long_id))["state"] == "running", 30, "the long job to run")
        first = job(int(long_id))
        node = str(first["node"])
        stale = [int(p) for p in first["pids"]]  # type: ignore[attr-defined]
        print(f"job {long_id} runs on {node} (task pid {stale}); kill -STOP its agent")
        agents[node].send_signal(signal.SIGSTOP)
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
        until(lambda: (st := proc_stat(stale[0])) is None or st.dead, 30,
              "the stale run to be killed")
        print(f"the stale attempt-1 task (pid {stale[0]}) was killed; its result discarded")
        until(lambda: all(n["state"] == "up" for n in json.loads(
            tether("nodes", "--json", show=False))), 30, f"{node} to rejoin")
        tether("nodes")
        tether("show", long_id)
        with open(os.path.join(base, f"{node}.log")) as f:
            print("".join(line for line in f if "cluster" in line or "stale" in line
                          or "no longer" in line)[-1500:])
    finally:
        say("stopping everything")
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
        pg.cleanup()
        shutil.rmtree(base, ignore_errors=True)
    print("done: the database, the agents, their supervisors and jobs are gone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
