"""Chaos: many mixed jobs on one agent that is SIGKILLed or SIGTERMed every few seconds, while
random supervisors are SIGKILLed; afterwards every job is accounted for.

    python -m bench.chaos                      # the release run: 1000 jobs, >= 50 restarts
    python -m bench.chaos --jobs 120 --seconds 45 --min-restarts 5 --min-sup-kills 2

Jobs (each names itself ``chaos-I``; every run of one appends a line to ``runs/I``): exit codes,
deaths by signal, printers whose every output line is checked, two-task jobs, jobs that outlive
their time limit (``timeout``, SIGTERM), jobs that depend on an earlier one (``afterok``: they
run after it completed, or are cancelled if it did not) and two-CPU jobs,
each sleeping a little so that restarts land in every window. Allocations and states are sampled
all along (``list``, every ``--sample`` seconds). It prints, and exits 1 unless all are 0:

  lost          jobs not final at the end, or ``lost`` though no supervisor of theirs was killed
  duplicated    jobs that ran more than once
  wrong         a final state, exit code, signal or output other than the job's own
  double-booked CPU ids two active jobs held in one answer of the agent (one ``list`` page: a
                sample of several pages is not one instant), and jobs whose tasks' times
                (``started_at`` to ``ended_at``) overlap on one CPU id
  illegal       state changes the lifecycle forbids (out of a final state, running -> pending,
                the attempt going down)
  leaked        processes of the jobs, supervisors or run directories left after the end

A job whose supervisor the run killed may end ``lost`` (that is the truth about it) but must still
never run twice.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from bench.common import kill_tree
from tether.shared.client import Client, probe_unix
from tether.shared.errors import TetherError
from tether.shared.paths import Layout
from tether.shared.procid import proc_stat

FINAL = ("completed", "failed", "cancelled", "lost", "timeout")
SIGNALS = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL, "USR1": signal.SIGUSR1}


@dataclass
class Spec:
    index: int
    command: list[str]
    cpus: int = 1
    ntasks: int = 1
    state: str = "completed"
    exit_code: int | None = 0
    signal: int | None = None
    lines: list[str] | None = None  # the exact output, sorted
    time_limit: float | None = None
    after: int | None = None  # afterok on this earlier job (its index)


def make_spec(i: int, rng: random.Random, runs: str) -> Spec:
    mark = f'[ "$TETHER_TASK_ID" = 0 ] && echo x >> {runs}/{i}; '
    nap = rng.choice([0, 0, 0, 0.2, 0.5, 1.0, 2.0])
    kind = rng.random()
    if kind < 0.3:
        code = rng.choice([0, 0, 1, 3, 42, 255])
        return Spec(i, ["sh", "-c", f"{mark}sleep {nap}; exit {code}"],
                    state="completed" if code == 0 else "failed", exit_code=code)
    if kind < 0.45:
        name = rng.choice(sorted(SIGNALS))
        return Spec(i, ["sh", "-c", f"{mark}sleep {nap}; kill -s {name} $$"], state="failed",
                    exit_code=None, signal=int(SIGNALS[name]))
    if kind < 0.75:
        n = rng.choice([1, 10, 100, 1000])
        return Spec(i, ["sh", "-c", f'{mark}i=0; while [ $i -lt {n} ]; do echo "job{i} line $i"; '
                                    f"i=$((i+1)); done; sleep {nap}"],
                    lines=sorted(f"job{i} line {k}" for k in range(n)))
    if kind < 0.9:
        return Spec(i, ["sh", "-c", f'{mark}echo "task $TETHER_TASK_ID"; sleep {nap}'], ntasks=2,
                    lines=["task 0", "task 1"])
    if kind < 0.95:  # outlives its time limit: SIGTERM from its supervisor, whatever restarts
        return Spec(i, ["sh", "-c", f"{mark}sleep 60"], state="timeout", exit_code=None,
                    signal=int(signal.SIGTERM), time_limit=rng.choice([0.5, 1.0, 2.0]))
    if kind < 0.975 and i > 0:  # runs after an earlier job completed, or never (check())
        return Spec(i, ["sh", "-c", f"{mark}sleep {nap}"], after=rng.randrange(max(0, i - 20), i))
    return Spec(i, ["sh", "-c", f'{mark}[ "$(echo "$TETHER_CPUS" | tr , "\\n" | wc -l)" = 2 ] '
                                f"|| exit 99; sleep {nap}"], cpus=2)


class Agent:
    """The agent under test: started, killed and started again."""

    def __init__(self, base: str, cpus: int) -> None:
        self.state = os.path.join(base, "s")
        self.layout = Layout(self.state)
        self.cpus = cpus
        self.log = open(os.path.join(base, "agent.log"), "ab")  # noqa: SIM115
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tether.cli.main", "agent", "--state-dir", self.state,
             "--cpus", str(self.cpus), "--oversubscribe", "--cancel-grace", "2"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.monotonic() + 60
        while call(self.layout, "status", {}) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the agent did not start (see {self.log.name})")
            time.sleep(0.02)

    def stop(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(60)


def call(layout: Layout, kind: str, args: dict[str, Any], timeout: float = 5.0) -> Any:
    """One request; None if the agent is not there or did not answer."""
    if probe_unix(layout.sock) is not None:
        return None
    try:
        with Client(layout.sock, timeout=timeout) as c:
            return c.call(kind, args)
    except TetherError:
        return None


def all_jobs(layout: Layout) -> list[dict[str, Any]] | None:
    jobs: list[dict[str, Any]] = []
    while True:
        page = call(layout, "list", {"after": jobs[-1]["id"] if jobs else 0}, timeout=10)
        if page is None:
            return None
        jobs.extend(page["jobs"])
        if not page["more"]:
            return jobs


@dataclass
class Tally:
    restarts: int = 0
    sup_kills: int = 0
    samples: int = 0
    double_booked: list[str] = field(default_factory=list)
    illegal: list[str] = field(default_factory=list)
    sup_killed_jobs: set[int] = field(default_factory=set)
    seen: dict[int, dict[str, Any]] = field(default_factory=dict)


def supervisors(state: str) -> dict[int, int]:
    """pid -> job of every live supervisor of this state directory (from their titles; its
    output opener, a fork of it, has the same title and is left out)."""
    found = {}
    marker = f" dir={state}/run/".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if cmd.startswith(b"tether-supervisor ") and marker in cmd:
            try:
                found[int(name)] = int(cmd.split(b"job=")[1].split()[0])
            except (IndexError, ValueError):
                continue
    for pid in list(found):
        st = proc_stat(pid)
        if st is None or st.ppid in found:
            del found[pid]
    return found


def chaos(agent: Agent, tally: Tally, rng: random.Random, stop: threading.Event,
          every: tuple[float, float]) -> None:
    """Kill the agent (SIGKILL or SIGTERM) every ``every`` seconds (2-6 s) and start it again
    at once."""
    while not stop.wait(rng.uniform(*every)):
        with agent.lock:
            agent.stop(rng.choice([signal.SIGKILL, signal.SIGTERM]))
            agent.start()
            tally.restarts += 1


def kill_supervisors(agent: Agent, tally: Tally, rng: random.Random, stop: threading.Event,
                     every: float) -> None:
    """SIGKILL a random live supervisor every ``every`` seconds on average (whenever one runs)."""
    while not stop.wait(rng.uniform(0.5, 1.5) * every):
        while not stop.is_set():
            sups = supervisors(agent.state)
            if sups:
                pid = rng.choice(sorted(sups))
                try:
                    os.kill(pid, signal.SIGKILL)
                    tally.sup_kills += 1
                    tally.sup_killed_jobs.add(sups[pid])
                except ProcessLookupError:
                    continue
                break
            stop.wait(0.1)


def sample(agent: Agent, tally: Tally, stop: threading.Event, every: float) -> None:
    while not stop.wait(every):
        pages = list_pages(agent.layout)
        if pages is None:
            continue
        tally.samples += 1
        for page in pages:
            held: dict[int, int] = {}  # per page: one page is one instant of the agent
            for j in page:
                check_transition(tally, j)
                if j["state"] in ("starting", "running"):
                    for cpu in j["cpus"]:
                        if cpu in held:
                            tally.double_booked.append(
                                f"CPU {cpu} held by jobs {held[cpu]} and {j['id']}")
                        held[cpu] = j["id"]


def check_transition(tally: Tally, j: dict[str, Any]) -> None:
    prev = tally.seen.get(j["id"])
    if prev is not None:
        why = None
        if prev["state"] in FINAL and (j["state"], j["exit_code"], j["signal"]) != (
                prev["state"], prev["exit_code"], prev["signal"]):
            why = f"{prev['state']} -> {j['state']}"
        elif prev["state"] == "running" and j["state"] == "pending":
            why = "running -> pending"
        elif j["attempt"] < prev["attempt"]:
            why = f"attempt {prev['attempt']} -> {j['attempt']}"
        if why:
            tally.illegal.append(f"job {j['id']}: {why}")
    tally.seen[j["id"]] = j


def list_pages(layout: Layout) -> list[list[dict[str, Any]]] | None:
    pages: list[list[dict[str, Any]]] = []
    after = 0
    while True:
        page = call(layout, "list", {"after": after}, timeout=10)
        if page is None:
            return None
        pages.append(page["jobs"])
        if not page["more"] or not page["jobs"]:
            return pages
        after = page["jobs"][-1]["id"]


def overlaps(jobs: dict[int, dict[str, Any]]) -> list[str]:
    """Jobs whose tasks ran on one CPU id at once, from their final records: the tasks of the
    next holder start after the last holder's ended (RFC 3339 UTC with milliseconds sorts)."""
    by_cpu: dict[int, list[tuple[str, str, int]]] = {}
    for j in jobs.values():
        if j["started_at"] and j["ended_at"]:
            for cpu in j["cpus"]:
                by_cpu.setdefault(cpu, []).append((j["started_at"], j["ended_at"], j["id"]))
    out = []
    for cpu, spans in sorted(by_cpu.items()):
        spans.sort()
        last_end, last = "", 0  # the latest end so far, and whose
        for start, end, job in spans:
            if start < last_end:
                out.append(f"CPU {cpu}: job {job} started at {start}, before job {last} "
                           f"ended ({last_end})")
            if end > last_end:
                last_end, last = end, job
    return out


def submit_all(agent: Agent, specs: list[Spec], work: str, ids: dict[int, int],
               stop: threading.Event) -> None:
    env = {"PATH": "/usr/bin:/bin", "CHAOS_MARK": work}
    for s in specs:
        name = f"chaos-{s.index}"
        while not stop.is_set():
            args: dict[str, Any] = {
                "command": s.command, "name": name, "cpus": s.cpus, "ntasks": s.ntasks,
                "workdir": work, "env": env}
            if s.time_limit is not None:
                args["time_limit"] = s.time_limit
            if s.after is not None:
                args["dependency"] = f"afterok:{ids[s.after]}"
            res = call(agent.layout, "submit", args)
            if res is not None:
                ids[s.index] = res["id"]
                break
            # No answer: the agent may have recorded it before it died (the reply is sent only
            # once the record is durable, and a SIGKILL can fall in between). Never submit
            # twice: submit again only once an agent answers that it has no such job.
            while (jobs := all_jobs(agent.layout)) is None and not stop.is_set():
                time.sleep(0.05)
            mine = [j for j in jobs or [] if j["name"] == name]
            if mine:
                ids[s.index] = mine[0]["id"]
                break


def leftovers(state: str, work: str) -> list[str]:
    out = [f"supervisor pid {p} (job {j})" for p, j in supervisors(state).items()]
    run = os.path.join(state, "run")
    if os.path.isdir(run):
        out += [f"run directory {d}" for d in os.listdir(run)]
    marker = f"CHAOS_MARK={work}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
        except OSError:
            continue
        out.append(f"task process {name}")
    return out


def check(specs: list[Spec], ids: dict[int, int], jobs: dict[int, dict[str, Any]],
          tally: Tally, runs: str) -> dict[str, list[str]]:
    bad: dict[str, list[str]] = {"lost": [], "duplicated": [], "wrong": []}
    for s in specs:
        job_id = ids.get(s.index)
        j = jobs.get(job_id) if job_id is not None else None
        try:
            with open(os.path.join(runs, str(s.index))) as f:
                ran = len(f.read().split())
        except FileNotFoundError:
            ran = 0
        if ran > 1:
            bad["duplicated"].append(f"chaos-{s.index} (job {job_id}) ran {ran} times")
        if j is None or j["state"] not in FINAL:
            bad["lost"].append(f"chaos-{s.index}: {None if j is None else j['state']}")
            continue
        killed = j["id"] in tally.sup_killed_jobs
        if j["state"] == "lost":
            if not killed:
                bad["lost"].append(f"job {j['id']}: lost ({j['reason']})")
            continue
        got = (j["state"], j["exit_code"] if s.signal is None else None, j["signal"])
        want = (s.state, s.exit_code, s.signal)
        if s.after is not None:
            parent = jobs.get(ids.get(s.after, -1))
            if parent is None or parent["state"] != "completed":
                want = ("cancelled", None, None)  # its dependency can never be satisfied
                if ran:
                    bad["wrong"].append(f"job {j['id']} ran though job "
                                        f"{None if parent is None else parent['id']} did not "
                                        "complete")
            elif not (j["started_at"] or "") >= (parent["ended_at"] or "~"):
                bad["wrong"].append(f"job {j['id']} started at {j['started_at']}, before its "
                                    f"dependency {parent['id']} ended ({parent['ended_at']})")
        if got != want:
            bad["wrong"].append(f"job {j['id']}: {got}, expected {want} ({j['reason']})")
        elif s.lines is not None:
            try:
                with open(j["output"]) as f:
                    lines = sorted(f.read().splitlines())
            except OSError as exc:
                lines = [f"<{exc}>"]
            if lines != s.lines:
                bad["wrong"].append(f"job {j['id']}: output differs ({len(lines)} lines, "
                                    f"expected {len(s.lines)})")
    return bad


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    base = tempfile.mkdtemp(dir="/tmp", prefix="tchaos")
    work = os.path.join(base, "w")
    runs = os.path.join(work, "runs")
    os.makedirs(runs)
    agent = Agent(base, args.cpus)
    specs = [make_spec(i, rng, runs) for i in range(args.jobs)]
    ids: dict[int, int] = {}
    tally = Tally()
    stop_chaos, stop_sampling = threading.Event(), threading.Event()
    t0 = time.monotonic()
    try:
        agent.start()
        threads = [
            threading.Thread(target=chaos, args=(agent, tally, random.Random(args.seed + 1),
                                                 stop_chaos, args.restart_every), daemon=True),
            threading.Thread(target=sample, args=(agent, tally, stop_sampling, args.sample),
                             daemon=True),
            threading.Thread(target=kill_supervisors,
                             args=(agent, tally, random.Random(args.seed + 2), stop_chaos,
                                   args.sup_every), daemon=True),
        ]
        for t in threads:
            t.start()
        submit_all(agent, specs, work, ids, threading.Event())
        # Chaos until every job has ended, the minimum restarts are reached and the time is up.
        while True:
            jobs = all_jobs(agent.layout) or []
            done = sum(1 for j in jobs if j["state"] in FINAL)
            enough = (tally.restarts >= args.min_restarts
                      and tally.sup_kills >= args.min_sup_kills)
            if (done >= len(specs) and enough) or time.monotonic() - t0 > args.seconds * 4:
                break
            if time.monotonic() - t0 > args.seconds and enough:
                break
            time.sleep(0.5)
        stop_chaos.set()
        threads[0].join()
        threads[2].join()
        # Calm: let every job end and every supervisor be acknowledged.
        deadline = time.monotonic() + args.drain
        final: dict[int, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            jobs = all_jobs(agent.layout) or []
            final = {j["id"]: j for j in jobs}
            if (len(ids) == len(specs) and all(final.get(i, {}).get("state") in FINAL
                                                for i in ids.values())
                    and not supervisors(agent.state)):
                break
            time.sleep(0.2)
        stop_sampling.set()
        threads[1].join()
        bad = check(specs, ids, final, tally, runs)
        tally.double_booked += overlaps(final)
        leaked = leftovers(agent.state, work)
        elapsed = time.monotonic() - t0
    finally:
        if agent.proc is not None and agent.proc.poll() is None:
            agent.stop(signal.SIGTERM)
        kill_tree(agent.state)
        agent.log.close()
        log_path = agent.log.name
        if args.keep:
            print(f"kept {base}")
    figures = {
        "jobs": len(specs), "seconds": round(elapsed, 1), "agent_restarts": tally.restarts,
        "supervisor_kills": tally.sup_kills, "allocation_samples": tally.samples,
        "lost": len(bad["lost"]), "duplicated": len(bad["duplicated"]),
        "wrong": len(bad["wrong"]), "double_booked": len(tally.double_booked),
        "illegal_transitions": len(tally.illegal), "leaked": len(leaked),
    }
    for key, value in figures.items():
        print(f"{key:>20}: {value}")
    problems = [*bad["lost"], *bad["duplicated"], *bad["wrong"], *tally.double_booked,
                *tally.illegal, *leaked]
    for p in problems[:40]:
        print(f"  - {p}")
    print(json.dumps(figures))
    if problems:
        print(f"agent log: {log_path}")
    else:
        shutil.rmtree(base, ignore_errors=True)
    ok = not problems and tally.restarts >= args.min_restarts and \
        tally.sup_kills >= args.min_sup_kills
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=300.0,
                   help="keep the chaos going at least this long (and until every job ended)")
    p.add_argument("--min-restarts", type=int, default=50)
    p.add_argument("--min-sup-kills", type=int, default=20)
    p.add_argument("--restart-every", type=float, nargs=2, default=(2.0, 6.0),
                   metavar=("MIN", "MAX"), help="seconds between agent kills (uniform)")
    p.add_argument("--sup-every", type=float, default=6.0,
                   help="seconds between supervisor kills, on average")
    p.add_argument("--sample", type=float, default=0.5, help="seconds between samples")
    p.add_argument("--drain", type=float, default=120.0,
                   help="seconds allowed for the calm end (every job final, every ack done)")
    p.add_argument("--cpus", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the state directory")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
