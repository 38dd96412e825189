"""Demo: start an agent, run jobs, SIGKILL the agent mid-run, start it again, and watch every job
finish with its true exit code and unbroken output. Cleans up everything it started."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

TETHER = [sys.executable, "-m", "tether.cli.main"]


#: bold headings on a terminal only: no escape codes in a file or a pipe (or with NO_COLOR set)
COLOUR = sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m" if COLOUR else f"\n== {text}", flush=True)


def remove_cgroups(state: str) -> None:
    """The steps' cgroups an agent on ``state`` made (its default base), and the base."""
    from tether.agent import contain

    contain.remove_all(contain.default_base(state))


def main() -> int:
    base = tempfile.mkdtemp(dir="/tmp", prefix="tether-demo.")
    state, work = os.path.join(base, "state"), os.path.join(base, "work")
    os.makedirs(work)
    env = dict(os.environ, TETHER_STATE_DIR=state)
    agents: list[subprocess.Popen[bytes]] = []

    def tether(*args: str, check: bool = True) -> str:
        res = subprocess.run([*TETHER, *args], env=env, cwd=work, capture_output=True, text=True)
        if check and res.returncode != 0:
            raise SystemExit(f"tether {' '.join(args)} failed: {res.stderr.strip()}")
        return res.stdout

    def start_agent() -> subprocess.Popen[bytes]:
        log = open(os.path.join(base, f"agent{len(agents)}.log"), "wb")  # noqa: SIM115
        proc = subprocess.Popen([*TETHER, "agent", "--cpus", "4", "--oversubscribe"], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        agents.append(proc)
        deadline = time.monotonic() + 20
        while subprocess.run([*TETHER, "status"], env=env, capture_output=True).returncode:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the agent did not start; see " + log.name)
            time.sleep(0.05)
        return proc

    try:
        say(f"starting an agent on {state}")
        agent = start_agent()
        print(tether("status"), end="")
        say("submitting jobs")
        ticker = tether("submit", "--name", "ticker", "--", "sh", "-c",
                        'for i in $(seq 1 8); do echo "tick $i"; sleep 1; done').strip()
        seven = tether("submit", "--name", "exit-7", "--", "sh", "-c", "sleep 3; exit 7").strip()
        ok = tether("submit", "--name", "quick", "--", "true").strip()
        print(f"ticker={ticker} exit-7={seven} quick={ok}")
        time.sleep(2)
        print(tether("list"), end="")
        sups = json.loads(tether("list", "--json"))
        say(f"SIGKILL the agent (pid {agent.pid}) while jobs run")
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        time.sleep(2)  # the exit-7 job ends while no agent is running
        for j in sups:
            if j["state"] == "running":
                alive = os.path.exists(f"/proc/{j['supervisor_pid']}")
                print(f"job {j['id']}: supervisor {j['supervisor_pid']} "
                      f"{'still running' if alive else 'GONE'}")
        print(f"inspect {seven} (asks its supervisor directly, no agent):")
        print(tether("inspect", seven, check=False), end="")
        say("starting the agent again")
        agent = start_agent()
        print(tether("list"), end="")
        say("waiting for every job")
        for jid in (ticker, seven, ok):
            rc = subprocess.run([*TETHER, "wait", jid], env=env).returncode
            print(f"tether wait {jid} -> exit {rc}")
        print(tether("list"), end="")
        out = json.loads(tether("show", ticker, "--json"))["output"]
        say(f"output of the ticker ({os.path.basename(out)}): one line each, none lost or "
            "repeated")
        with open(out) as f:
            print(f.read(), end="")
        print(tether("status"), end="")
        return 0
    finally:
        say("stopping everything")
        for proc in agents:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait()
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/cmdline", "rb") as f:
                        if state.encode() in f.read():
                            os.kill(int(name), signal.SIGKILL)
                except OSError:
                    pass
        remove_cgroups(state)
        shutil.rmtree(base, ignore_errors=True)
        print("done")


if __name__ == "__main__":
    sys.exit(main())
