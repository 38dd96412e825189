"""The ``tether`` command line. Errors are one line on stderr and a non-zero exit.

Exit codes: 0 success; 1 an error (no agent, unknown job, refused request); 2 bad usage;
``wait`` exits with the job's own code, 128+N for signal N, and 124 on timeout.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time
from typing import Any, NoReturn

from shared import protocol
from shared.client import Client, probe_unix
from shared.errors import RemoteError, TetherError, Unreachable
from shared.paths import Layout, default_state_dir

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 124


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(f"{self.prog}: {message}", EXIT_USAGE)


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def job_id(text: str) -> int:
    if not re.fullmatch(r"[1-9][0-9]{0,17}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a job id")
    return int(text)


def env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def build_parser() -> Parser:
    p = Parser(prog="tether", description="Run jobs under per-step supervisors.")
    p.add_argument("--state-dir", help="agent state directory (default: $TETHER_STATE_DIR, "
                   "/var/lib/tether for root, else ~/.local/state/tether)")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)

    a = sub.add_parser("agent", help="run the node agent in the foreground")
    a.add_argument("--state-dir", dest="sub_state_dir")
    a.add_argument("--cpus", type=positive, help="model a node with CPU ids 0..N-1")
    a.add_argument("--gpus", type=non_negative, default=0)
    a.add_argument("--memory-mb", type=non_negative)
    a.add_argument("--node", help="node name (default: the host name)")
    a.add_argument("--cancel-grace", type=seconds, default=10.0,
                   help="seconds between SIGTERM and SIGKILL on cancel (default 10)")
    a.add_argument("--claim-timeout", type=seconds, default=120.0,
                   help="how long a supervisor waits to be claimed (default 120)")
    a.add_argument("--linger", type=seconds, default=3600.0,
                   help="how long a supervisor keeps an unacknowledged result (default 3600)")
    a.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    def common(name: str, help: str, json_flag: bool = True) -> Parser:
        sp: Parser = sub.add_parser(name, help=help)
        sp.add_argument("--state-dir", dest="sub_state_dir")
        if json_flag:
            sp.add_argument("--json", action="store_true")
        return sp

    common("status", "is the agent answering; what does it hold")
    s = common("submit", "queue a job: tether submit [OPTIONS] -- COMMAND [ARG...]")
    s.add_argument("--cpus", type=positive, default=1, help="CPUs per task")
    s.add_argument("--gpus", type=non_negative, default=0)
    s.add_argument("--memory-mb", type=non_negative, default=0)
    s.add_argument("--ntasks", type=positive, default=1)
    s.add_argument("--name")
    s.add_argument("--output")
    s.add_argument("--error")
    s.add_argument("--workdir")
    s.add_argument("--env", type=env_pair, action="append", default=[])
    s.add_argument("--user", help="run the tasks as this user (an agent running as root only)")
    s.add_argument("--pmi", choices=["none", "pmi1", "pmi2"], default="none",
                   help="serve PMI to the ranks from the step's supervisor (MPI jobs)")
    s.add_argument("--wait", action="store_true")
    s.add_argument("command", nargs=argparse.REMAINDER)
    common("list", "list jobs, newest last")
    sh = common("show", "show one job")
    sh.add_argument("job", type=job_id)
    w = common("wait", "wait for a job; exit with its exit code", json_flag=False)
    w.add_argument("job", type=job_id)
    w.add_argument("--timeout", type=seconds)
    c = common("cancel", "cancel a job", json_flag=False)
    c.add_argument("job", type=job_id)
    i = common("inspect", "ask the job's supervisor directly (works while the agent is down)")
    i.add_argument("job", type=job_id)
    i.add_argument("--pmi", action="store_true", help="show the step's PMI state")
    return p


# ---- talking to the agent and to supervisors --------------------------------------------------


def agent_call(layout: Layout, kind: str, args: dict[str, Any] | None = None,
               timeout: float = 10.0) -> Any:
    why = probe_unix(layout.sock)
    if why is not None:
        raise CliError(f"no agent is answering at {layout.sock} ({why})")
    with Client(layout.sock, timeout=timeout) as client:
        try:
            return client.call(kind, args or {})
        except Unreachable as exc:
            raise CliError(f"the agent did not answer: {exc.message}") from None


def supervisor_path(layout: Layout, job: int) -> str:
    attempts = []
    for path in glob.glob(os.path.join(layout.run_root, f"{job}.*")):
        tail = path.rsplit(".", 1)[1]
        if tail.isdigit():
            attempts.append((int(tail), path))
    if not attempts:
        raise CliError(f"job {job} has no supervisor on this node (not running, or already "
                       "collected: try 'tether show')")
    return os.path.join(max(attempts)[1], "sock")


# ---- commands -----------------------------------------------------------------------------


def fmt_exit(job: dict[str, Any]) -> str:
    if job.get("signal") is not None:
        return f"sig{job['signal']}"
    if job.get("exit_code") is not None:
        return str(job["exit_code"])
    return "-"


def exit_status(job: dict[str, Any]) -> int:
    if job.get("signal") is not None:
        return 128 + int(job["signal"])
    if job.get("exit_code") is not None:
        return int(job["exit_code"])
    return 0 if job["state"] == "completed" else EXIT_ERROR


def print_job(job: dict[str, Any]) -> None:
    for key in ("id", "name", "state", "attempt", "exit_code", "signal", "reason", "command",
                "ntasks", "cpus", "gpus", "memory_mb", "supervisor_pid", "pids", "workdir",
                "output", "error", "submitted_at", "started_at", "ended_at"):
        value = job.get(key)
        if isinstance(value, list):
            value = " ".join(str(v) for v in value)
        print(f"{key:<15}{'' if value is None else value}")


def cmd_status(layout: Layout, ns: argparse.Namespace) -> int:
    try:
        st = agent_call(layout, "status", timeout=5.0)
    except CliError as exc:
        if ns.json:
            print(json.dumps({"running": False, "error": str(exc)}))
        print(f"tether: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if ns.json:
        print(json.dumps(st))
        return 0
    print(f"agent on node {st['node']} (version {st['version']}, pid {st['pid']})")
    for res in ("cpus", "gpus", "memory_mb"):
        print(f"  {res:<10} {st[res]['allocated']}/{st[res]['total']} allocated")
    print("  jobs       " + ", ".join(f"{k} {v}" for k, v in st["jobs"].items() if v))
    return 0


def cmd_submit(layout: Layout, ns: argparse.Namespace) -> int:
    command = list(ns.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("submit: missing the command to run (tether submit [OPTIONS] -- CMD)",
                       EXIT_USAGE)
    env = dict(os.environ)  # like sbatch's default --export=ALL
    env.update(dict(ns.env))
    workdir = os.path.abspath(ns.workdir or os.getcwd())
    args = {"command": command, "cpus": ns.cpus, "gpus": ns.gpus, "memory_mb": ns.memory_mb,
            "ntasks": ns.ntasks, "workdir": workdir, "env": env, "pmi": ns.pmi}
    for key in ("name", "output", "error", "user"):
        if getattr(ns, key) is not None:
            args[key] = getattr(ns, key)
    job = agent_call(layout, "submit", args)
    if ns.json and not ns.wait:
        print(json.dumps(job))
    else:
        print(job["id"], flush=True)
    if ns.wait:
        return wait_for(layout, job["id"], None, as_json=ns.json)
    return 0


def wait_for(layout: Layout, job: int, timeout: float | None, as_json: bool = False) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    warned = False
    while True:
        left = 30.0 if deadline is None else deadline - time.monotonic()
        if left <= 0:
            print(f"tether: job {job} did not end within {timeout:g}s", file=sys.stderr)
            return EXIT_TIMEOUT
        hold = max(0.0, min(left, 30.0))
        try:
            res = agent_call(layout, "wait", {"job": job, "hold": hold}, timeout=hold + 10.0)
        except CliError as exc:
            # The agent may be restarting: keep waiting (the job does not depend on it).
            if not warned:
                print(f"tether: {exc}; still waiting", file=sys.stderr)
                warned = True
            time.sleep(min(0.2, max(0.0, left)))
            continue
        if res.get("done"):
            if as_json:
                print(json.dumps(res["job"]))
            return exit_status(res["job"])


def cmd_list(layout: Layout, ns: argparse.Namespace) -> int:
    jobs: list[dict[str, Any]] = []
    while True:  # the agent answers in pages, so no reply outgrows a frame
        page = agent_call(layout, "list", {"after": jobs[-1]["id"] if jobs else 0})
        jobs.extend(page["jobs"])
        if not page["more"]:
            break
    if ns.json:
        print(json.dumps(jobs))
        return 0
    for j in jobs:
        print(f"{j['id']:>6}  {j['state']:<10} {fmt_exit(j):<6} {j['name']:<16} "
              f"{' '.join(j['command'])}")
    return 0


def cmd_show(layout: Layout, ns: argparse.Namespace) -> int:
    job = agent_call(layout, "show", {"job": ns.job})
    if ns.json:
        print(json.dumps(job))
    else:
        print_job(job)
    return 0


def cmd_wait(layout: Layout, ns: argparse.Namespace) -> int:
    agent_call(layout, "show", {"job": ns.job})  # an unknown job is an error, not a wait
    return wait_for(layout, ns.job, ns.timeout)


def cmd_cancel(layout: Layout, ns: argparse.Namespace) -> int:
    agent_call(layout, "cancel", {"job": ns.job})
    return 0


def cmd_inspect(layout: Layout, ns: argparse.Namespace) -> int:
    path = supervisor_path(layout, ns.job)
    why = probe_unix(path)
    if why is not None:
        raise CliError(f"job {ns.job}: its supervisor is not answering at {path} ({why})")
    with Client(path, timeout=5.0) as client:
        try:
            client.call("hello", {"versions": sorted(protocol.SUPPORTED_VERSIONS)})
            st = client.call("pmi" if ns.pmi else "state")
        except Unreachable as exc:
            raise CliError(f"job {ns.job}: {exc.message}") from None
    if ns.json:
        print(json.dumps(st))
        return 0
    if ns.pmi:
        print(f"{st['kind']} job {st['jobid']}: {st['size']} ranks, epoch {st['epoch']}, "
              f"{st['kvs_keys']} keys ({st['store_bytes']} bytes), waiting "
              f"{st['waiting'] or 'none'}{', failure: ' + st['failure'] if st['failure'] else ''}")
        for r in st["ranks"]:
            flags = [k for k in ("connected", "initialized", "finalized", "aborted", "exited")
                     if r.get(k)]
            print(f"  rank {r['rank']}: {r['protocol'] or '-'} {' '.join(flags)}")
        return 0
    for key in ("job", "attempt", "state", "phase", "supervisor_pid", "pids", "started_at",
                "ended_at"):
        value = st.get(key)
        if isinstance(value, list):
            value = " ".join(str(v) for v in value)
        print(f"{key:<15}{'' if value is None else value}")
    if st.get("exit"):
        print(f"{'exit':<15}{fmt_exit(st['exit'])} {st['exit'].get('reason') or ''}".rstrip())
    return 0


def cmd_agent(state_dir: str, ns: argparse.Namespace) -> int:
    import logging
    import socket

    from agent.daemon import Agent, AgentConfig, AgentError, allowed_cpus, memory_mb
    from shared.paths import PathTooLong

    logging.basicConfig(level=ns.log_level, stream=sys.stderr,
                        format="%(asctime)s agent[%(process)d] %(levelname)s %(message)s")
    cfg = AgentConfig(
        state_dir=os.path.abspath(state_dir),
        cpu_ids=list(range(ns.cpus)) if ns.cpus else allowed_cpus(),
        gpus=ns.gpus, memory_mb=memory_mb() if ns.memory_mb is None else ns.memory_mb,
        node=ns.node or socket.gethostname(), cancel_grace=ns.cancel_grace,
        claim_timeout=ns.claim_timeout, linger=ns.linger,
        faults=frozenset(f for f in os.environ.get("TETHER_AGENT_FAULT", "").split(",") if f),
    )
    try:
        return Agent(cfg).run()
    except (AgentError, PathTooLong) as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"agent: {exc}") from None


COMMANDS = {
    "status": cmd_status, "submit": cmd_submit, "list": cmd_list, "show": cmd_show,
    "wait": cmd_wait, "cancel": cmd_cancel, "inspect": cmd_inspect,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        ns = build_parser().parse_args(argv)
        state_dir = ns.sub_state_dir or ns.state_dir or default_state_dir()
        layout = Layout(os.path.abspath(state_dir))
        if ns.cmd == "agent":
            return cmd_agent(state_dir, ns)
        return COMMANDS[ns.cmd](layout, ns)
    except CliError as exc:
        print(f"tether: {exc}" if not str(exc).startswith("tether") else str(exc),
              file=sys.stderr)
        return exc.code
    except RemoteError as exc:
        print(f"tether: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except TetherError as exc:
        print(f"tether: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
