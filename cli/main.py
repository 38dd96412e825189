"""The ``tether`` command line. Errors are one line on stderr and a non-zero exit.

Exit codes: 0 success; 1 an error (no agent, unknown job, refused request); 2 bad usage;
``wait`` exits with the job's own code, 128+N for signal N, and 124 on timeout; 130 when
interrupted (Ctrl-C; ``attach`` detaches and the job keeps running).

``inspect``, ``attach`` and ``signal`` talk to the job's supervisor directly
(``shared.step_client``), never to the agent.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from tether.shared.client import Client, probe_unix
from tether.shared.errors import RemoteError, TetherError, Unreachable
from tether.shared.paths import Layout, default_state_dir
from tether.shared.step_client import StepClient, SupervisorGone, connect, parse_signal
from tether.shared.text import printable

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
    what = i.add_mutually_exclusive_group()
    what.add_argument("--pmi", action="store_true", help="show the step's PMI state")
    what.add_argument("--pids", action="store_true",
                      help="every task and every other process of the step")
    what.add_argument("--stats", action="store_true",
                      help="CPU time, current and peak memory, elapsed time")
    what.add_argument("--output", action="store_true",
                      help="the last lines of the step's stdout and stderr")
    what.add_argument("--events", action="store_true",
                      help="the step's events so far (tasks started and exited, step ended)")
    i.add_argument("--lines", type=non_negative, help="with --output: how many (default 10)")
    at = common("attach", "print the step's output so far, then follow it until the step "
                "ends (Ctrl-C detaches)", json_flag=False)
    at.add_argument("job", type=job_id)
    sg = common("signal", "send a signal to the step's tasks (each task's process group)",
                json_flag=False)
    sg.add_argument("job", type=job_id)
    sg.add_argument("signal", help="a name (TERM, SIGTERM, usr1) or a number")
    sg.add_argument("--rank", type=non_negative, help="only this task (default: every task)")
    return p


def say(*values: object, file: Any = None, flush: bool = False) -> None:
    """``print`` for text that jobs or peers control (names, commands, process titles, reasons,
    error messages): control characters are shown escaped, never sent to the terminal."""
    print(*(printable(v) for v in values), file=file, flush=flush)


# ---- talking to the agent and to supervisors --------------------------------------------------


#: The PATH of a job submitted for another user (``--user``): nothing of the submitter's.
USER_PATH = "/usr/local/bin:/usr/bin:/bin"
#: Arguments an agent of tether 0.1 does not know; left out when the door turns out to be one.
NEWER_ARGS = ("umask",)


def agent_call(layout: Layout, kind: str, args: dict[str, Any] | None = None,
               timeout: float = 10.0) -> Any:
    why = probe_unix(layout.sock)
    if why is not None:
        raise CliError(f"no agent is answering at {layout.sock} ({why})")
    with Client(layout.sock, timeout=timeout) as client:
        try:
            try:
                return client.call(kind, args or {})
            except RemoteError as exc:
                older = {k: v for k, v in (args or {}).items() if k not in NEWER_ARGS}
                if client.legacy is None or exc.code != "bad_request" or older == args:
                    raise
                return client.call(kind, older)  # a 0.1 agent: what it knows, nothing lost
        except Unreachable as exc:
            raise CliError(f"the agent did not answer: {exc.message}") from None


@contextmanager
def supervisor_errors(job: int) -> Iterator[None]:
    """A vanished or silent supervisor as one CLI error line."""
    try:
        yield
    except SupervisorGone as exc:
        raise CliError(exc.message) from None
    except Unreachable as exc:
        raise CliError(f"job {job}: {exc.message}") from None


def open_step(layout: Layout, job: int) -> StepClient:
    with supervisor_errors(job):
        return connect(job, state_dir=layout.state_dir, timeout=5.0)


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
        say(f"{key:<15}{'' if value is None else value}")


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
    # The submitter's environment, as sbatch's default --export=ALL: the agent adds none of its
    # own. For another user (root's --user) nothing of root's shell goes along: a plain PATH
    # and --env only.
    env = {"PATH": USER_PATH} if ns.user is not None else dict(os.environ)
    env.update(dict(ns.env))
    workdir = os.path.abspath(ns.workdir or os.getcwd())
    args = {"command": command, "cpus": ns.cpus, "gpus": ns.gpus, "memory_mb": ns.memory_mb,
            "ntasks": ns.ntasks, "workdir": workdir, "env": env, "pmi": ns.pmi,
            "umask": current_umask()}
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


def current_umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it; put it back at once
    os.umask(mask)
    return mask


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
        say(f"{j['id']:>6}  {j['state']:<10} {fmt_exit(j):<6} {j['name']:<16} "
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
    if ns.lines is not None and not ns.output:
        raise CliError("inspect: --lines goes with --output", EXIT_USAGE)
    info: dict[str, Any] | None = None
    with open_step(layout, ns.job) as step, supervisor_errors(ns.job):
        if ns.pids:
            return show_pids(step.pids(), ns.json)
        if ns.stats:
            return show_stats(step.stats(), ns.json)
        if ns.output:
            lines = 10 if ns.lines is None else ns.lines
            return show_output(step.call("output", {"lines": lines}), ns.json)
        if ns.events:
            return show_events(step, ns.json)
        st = step.pmi() if ns.pmi else step.state()
        if not ns.pmi:
            try:  # shown too when the caller may see it (the owner, root, the agent)
                info = step.info()
            except RemoteError as exc:  # not allowed, or a supervisor older than `info`
                if exc.code not in ("permission_denied", "unknown_kind"):
                    raise
    if ns.json:
        print(json.dumps(st if info is None else dict(st, info=info)))
        return 0
    if ns.pmi:
        say(f"{st['kind']} job {st['jobid']}: {st['size']} ranks, epoch {st['epoch']}, "
              f"{st['kvs_keys']} keys ({st['store_bytes']} bytes), waiting "
              f"{st['waiting'] or 'none'}{', failure: ' + st['failure'] if st['failure'] else ''}")
        for r in st["ranks"]:
            flags = [k for k in ("connected", "initialized", "finalized", "aborted", "exited")
                     if r.get(k)]
            say(f"  rank {r['rank']}: {r['protocol'] or '-'} {' '.join(flags)}")
        return 0
    for key in ("job", "attempt", "state", "phase", "supervisor_pid", "pids", "started_at",
                "ended_at"):
        value = st.get(key)
        if isinstance(value, list):
            value = " ".join(str(v) for v in value)
        say(f"{key:<15}{'' if value is None else value}")
    if st.get("exit"):
        say(f"{'exit':<15}{fmt_exit(st['exit'])} {st['exit'].get('reason') or ''}".rstrip())
    if info is not None:
        user = f"{info['user'] or '?'} (uid {info['uid']})"
        rows = [("name", info["name"]), ("command", " ".join(info["command"])), ("user", user),
                ("workdir", info["workdir"]), ("ntasks", info["ntasks"]),
                ("cpus", " ".join(str(c) for c in info["cpus"])),
                ("gpus", " ".join(str(g) for g in info["gpus"])),
                ("memory_mb", info["memory_mb"]), ("output", info["output"]),
                ("error", info["error"]), ("pmi", info["pmi"]),
                ("version", f"{info['version']} (protocol {info['protocol']})")]
        for key, value in rows:
            say(f"{key:<15}{'' if value is None else value}")
    return 0


def task_status(t: dict[str, Any]) -> str:
    if t["alive"]:
        return "alive"
    if t.get("signal") is not None:
        return f"killed by signal {t['signal']}"
    if t.get("exit_code") is not None:
        return f"exited {t['exit_code']}"
    return t.get("reason") or "not started"


def show_pids(res: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(res))
        return 0
    print(f"{'RANK':<6}{'PID':<9}STATUS")
    for t in res["tasks"]:
        say(f"{t['rank']:<6}{t['pid'] or '-':<9}{task_status(t)}")
    if res["processes"]:
        print(f"\n{'PID':<9}{'PPID':<9}{'RANK':<6}{'STATE':<6}COMMAND")
        for p in res["processes"]:
            rank = "-" if p["rank"] is None else p["rank"]
            note = "  (adopted by the supervisor)" if p["adopted"] else ""
            say(f"{p['pid']:<9}{p['ppid']:<9}{rank!s:<6}{p['state']:<6}{p['comm']}{note}")
    if res.get("truncated"):
        print("(more processes not shown)")
    return 0


def show_stats(res: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(res))
        return 0
    print(f"{'RANK':<9}{'PID':<9}{'USER_S':>9}{'SYS_S':>9}{'RSS_KB':>11}{'PEAK_KB':>11}"
          f"{'ELAPSED_S':>11}  STATUS")

    def row(label: str, pid: Any, u: dict[str, Any], status: str) -> None:
        elapsed = "" if u.get("elapsed") is None else f"{u['elapsed']:.2f}"
        print(f"{label:<9}{pid!s:<9}{u['cpu_user']:>9.2f}{u['cpu_system']:>9.2f}"
              f"{u['rss_kb']:>11}{u['peak_rss_kb']:>11}{elapsed:>11}  {status}".rstrip())
    for t in res["tasks"]:
        row(str(t["rank"]), t["pid"] or "-", t, "alive" if t["alive"] else "ended")
    if res["adopted"]["processes"]:
        row("adopted", "-", res["adopted"], f"{res['adopted']['processes']} process(es)")
    row("total", "-", res["total"], "")
    return 0


def show_output(res: dict[str, Any], as_json: bool) -> int:
    streams = [name for name in ("stdout", "stderr") if name in res]
    if as_json:
        print(json.dumps({name: dict(res[name], data=res[name]["data"].decode(
            errors="replace")) for name in streams}))
        return 0
    for name in streams:
        out = sys.stdout if name == "stdout" else sys.stderr
        out.flush()
        out.buffer.write(res[name]["data"])
        out.buffer.flush()
    return 0


def show_events(step: StepClient, as_json: bool) -> int:
    events: list[dict[str, Any]] = []
    while True:  # pages of at most 1000; hold 0: what there is now
        res = step.call("events", {"after": len(events)})
        events.extend(res["events"])
        if not res["events"]:
            break
    if as_json:
        print(json.dumps({"events": events, "ended": res["ended"]}))
        return 0
    for e in events:
        extra = " ".join(f"{k}={e[k]}" for k in ("rank", "pid", "state", "exit_code", "signal",
                                                  "reason") if e.get(k) is not None)
        say(f"{e['seq']:<6}{e['time']}  {e['kind']:<13} {extra}".rstrip())
    return 0


def cmd_attach(layout: Layout, ns: argparse.Namespace) -> int:
    outs = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}
    warned = False
    with open_step(layout, ns.job) as step, supervisor_errors(ns.job):
        offsets: dict[str, int] = {}
        while True:
            try:
                for name, data in step.follow_output(offsets=offsets):
                    outs[name].write(data)
                    outs[name].flush()
            except Unreachable as exc:  # alive but silent (stopped?): keep trying
                offsets = dict(step.offsets)
                if not warned:
                    print(f"tether: job {ns.job}: {exc.message}; still trying", file=sys.stderr,
                          flush=True)
                    warned = True
                continue
            except BrokenPipeError:  # our reader went away: detach quietly
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 0
            break
        if step.fell_back and step.last_phase not in ("exited", "aborted"):
            print(f"tether: job {ns.job}: its supervisor went away before the step ended; "
                  "the output was read to the end of its files", file=sys.stderr)
    return 0


def cmd_signal(layout: Layout, ns: argparse.Namespace) -> int:
    try:
        num = parse_signal(ns.signal)
    except ValueError as exc:
        raise CliError(f"signal: {exc}", EXIT_USAGE) from None
    with open_step(layout, ns.job) as step, supervisor_errors(ns.job):
        step.signal(num, ns.rank)
    return 0


def cmd_agent(state_dir: str, ns: argparse.Namespace) -> int:
    import logging
    import socket

    from tether.agent.daemon import Agent, AgentConfig, AgentError, allowed_cpus, memory_mb
    from tether.shared.paths import PathTooLong

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
    "wait": cmd_wait, "cancel": cmd_cancel, "inspect": cmd_inspect, "attach": cmd_attach,
    "signal": cmd_signal,
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
        say(f"tether: {exc}" if not str(exc).startswith("tether") else str(exc),
              file=sys.stderr)
        return exc.code
    except RemoteError as exc:
        say(f"tether: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except TetherError as exc:
        say(f"tether: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
