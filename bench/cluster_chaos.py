"""Chaos on a cluster: three agents on a real PostgreSQL, killed, stopped past the heartbeat
timeout, the database restarted, one node taken away for good; afterwards every run is checked.

    python -m bench.cluster_chaos                         # the release run: 400 jobs
    python -m bench.cluster_chaos --jobs 60 --seconds 60  # a quick one (about 2 minutes)

The script starts everything itself, as a site would have it (docs/cluster.md): a scratch
PostgreSQL (tests/pgserver.py), ``tether cluster init --heartbeat-timeout 3 --fence-margin 1.5
--root-jobs allow`` and ``tether cluster add-node`` as the administrator (PostgreSQL's superuser,
the tables' owner), three agents ``n0 n1 n2`` (4 CPUs each, ``--heartbeat 0.5``) joined with
``--cluster-file``. Jobs are submitted as people submit them: to a member agent's door (the CLI's
client; a random live agent each time), as root. Everything is killed and removed on the way out,
whatever failed: the agents, their templates, supervisors and tasks, the database, the nodes'
roles, the server and the temporary directories (a failed run, or ``--keep``, keeps the agents'
and supervisors' logs, the markers, PostgreSQL's log and the timeline in a directory it names).
The code under test is the working tree's, as installed in the venv.

Jobs (``cc-I``; mostly ``sleep`` 0.2-3 s, some longer, some exiting 1, 3, 42 or 77, some
``--no-requeue``) write a start and an end marker, each with the node's name, the cluster's job
id and attempt (``TETHER_CLUSTER_JOB_ID``, ``TETHER_CLUSTER_ATTEMPT``) and their own timestamp
(``date +%s.%N``), to stdout, whose file is ``out-%j-%N.txt``: ``%N`` is expanded by the node that
claims the job, which is how its name reaches the job (the job reads it back from the name of
its stdout, ``/proc/$$/fd/1``). Each run also appends the same lines to ``runs/J`` in the shared
work directory: an output file is opened with O_TRUNC, so a later run of the job on the same
node would erase an earlier run's markers from it. A sleep killed without its shell makes the
run exit 99 with no end marker (never taken for a run that ended).

Jobs are submitted over 85% of ``--seconds``. Chaos, one event at a time, every 2-5 s
(``--every``), on a random node whose agent is up: SIGKILL (sometimes SIGTERM) of its agent,
restarted at once or only after the timeout and margin; SIGSTOP of its agent past the timeout
and margin (or, sometimes, between the two), then SIGCONT; a PostgreSQL restart (fast shutdown,
down longer than the timeout, then started again). Once, at a random moment, a node is taken
away for good: its agent and every process of its steps are killed, each process group at once
(verified gone in /proc: nothing naming its state directory, nothing of its steps' sessions, no
task of its runs), and then ``tether cluster node-down NAME --confirm-dead`` is run, as an
administrator who knows the machine is off; it is one that runs a ``--no-requeue`` job at that
moment (two long ``--no-requeue`` jobs are submitted then to make sure there is one).

How the end of a run is known. A run that ends writes its end marker. A run that is killed (by
its supervisor's fencing, by its returning agent, by the take-away) writes none; its end is taken
as the end of the first scan of /proc, begun after its start marker, that found none of its
processes (``--scan`` every 0.05 s: every process whose environment carries this run's work
directory, ``TETHER_CLUSTER_JOB_ID`` and ``TETHER_CLUSTER_ATTEMPT``; a zombie counts as dead).
That is an upper bound on the moment its last process died, never earlier than the truth, so an
overlap can be reported where none was (by at most a scan) but never missed. A run still alive
at the end has no end.

It prints, and exits 1 unless all hold (and the minimum chaos was done):

  overlapping runs       two runs of one job whose [start, end] intervals overlap (any nodes),
                         or one attempt started twice
  lost                   jobs not final at the end, or final ``lost``
  results twice          per job, more than one final (not ``lost``) row in tether_attempts,
                         or the job's result not that of its last attempt
  wrongly declared down  a node declared down (from the sampled ``tether_nodes`` rows, the lost
                         attempts' rows and the agents' logs) though it had been beating for the
                         whole heartbeat timeout and margin before: none of its agent killed,
                         stopped or its node taken away in that window. A database outage does
                         not excuse one (the cluster must not take its own outage for a node's)
  no-requeue taken away  every --no-requeue job running on the node taken away ends node_fail
                         and never runs again (and there was at least one)
  wrong                  a final state or exit code other than the job's own (node_fail only for
                         --no-requeue jobs), a result with no run that ended so behind it, a run
                         after the job's final attempt, a marker naming another node than the
                         one whose tasks carried it
  leaked                 tasks of the jobs alive after the end

Said but not failed: ``not_declared_down_in_time``, a node whose agent was away (killed, stopped)
past the timeout and margin + 1 s while another node beat all along and the database was up, and
that no witness saw declared down meanwhile (a slow failover, not a safety matter: its steps
fenced themselves). ``--check-the-checker`` makes the administrator lie (confirm the node dead
before its steps are killed): the run must then FAIL with an overlapping run, which tests this
script's own analysis.
"""

from __future__ import annotations

import argparse
import bisect
import glob
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import psycopg  # noqa: E402
from psycopg.rows import dict_row  # noqa: E402

from bench.common import kill_tree, naming  # noqa: E402
from tests.pgserver import ScratchPostgres  # noqa: E402
from tether.shared import stamps  # noqa: E402
from tether.shared.client import Client, NotListening  # noqa: E402
from tether.shared.errors import TetherError, Unreachable  # noqa: E402
from tether.shared.paths import Layout  # noqa: E402

TETHER = [sys.executable, "-m", "tether.cli.main"]
HEARTBEAT, TIMEOUT, MARGIN = 0.5, 3.0, 1.5
DB = "tether_chaos"
NODES = ("n0", "n1", "n2")
FINAL = ("completed", "failed", "cancelled", "lost", "timeout", "node_fail")
ACTIVE = ("starting", "running")
#: a declaration's lookback is widened by this much (the samples' and clocks' slack)
SLACK = 0.3
#: the jobs are submitted over this part of --seconds (the rest: their runs, under chaos)
SUBMIT_SPAN = 0.85


def log(msg: str) -> None:
    print(f"[cluster_chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- jobs -------------------------------------------------------------------------------------


@dataclass
class Spec:
    index: int
    name: str
    sleep: float
    code: int = 0
    requeue: bool = True

    @property
    def state(self) -> str:
        return "completed" if self.code == 0 else "failed"


def make_spec(i: int, rng: random.Random) -> Spec:
    sleep = round(rng.uniform(0.2, 3.0) if rng.random() < 0.9 else rng.uniform(3.0, 8.0), 2)
    code = rng.choice((1, 3, 42, 77)) if rng.random() < 0.2 else 0
    return Spec(i, f"cc-{i}", sleep, code, requeue=rng.random() >= 0.12)


def script(spec: Spec, runs: str) -> str:
    """The job: a start marker, a sleep, an end marker, its exit code. The node's name is in the
    name of its stdout (``out-J-%N.txt``, expanded by the claiming node). A sleep killed on its
    own (not with its shell) ends the run with no end marker, exit 99: never taken for done."""
    mark = (f'echo "$l"; echo "$l" >> {runs}/$TETHER_CLUSTER_JOB_ID')
    return ('o=$(readlink /proc/$$/fd/1); n=${o##*-}; n=${n%.txt}; '
            'm="$n $TETHER_CLUSTER_JOB_ID $TETHER_CLUSTER_ATTEMPT"; '
            f'l="start $m $(date +%s.%N)"; {mark}; sleep {spec.sleep} || exit 99; '
            f'l="end $m $(date +%s.%N) {spec.code}"; {mark}; exit {spec.code}')


# ---- the database, as its owner (reads only) --------------------------------------------------


class Owner:
    """The tables' owner's connection, for reading; reconnected after a PostgreSQL restart.
    One per thread (a connection is not shared between threads)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn: psycopg.Connection[dict[str, Any]] | None = None

    def try_rows(self, query: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]] | None:
        """The rows, or None if the database cannot be reached now."""
        try:
            if self.conn is None or self.conn.closed:
                self.conn = psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row,
                                            connect_timeout=3)
            cur = self.conn.execute(query, params or None)
            return cur.fetchall() if cur.description else []
        except psycopg.OperationalError:
            self.close()
            return None

    def rows(self, query: str, params: tuple[Any, ...] = (), wait: float = 120.0) -> list[
            dict[str, Any]]:
        deadline = time.monotonic() + wait
        while (got := self.try_rows(query, params)) is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"the database did not answer within {wait:g}s")
            time.sleep(0.2)
        return got

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except psycopg.Error:
                pass
            self.conn = None


# ---- /proc --------------------------------------------------------------------------------------


def session_state(sid: int, cache: dict[int, str]) -> str:
    """The state directory of the supervisor leading session ``sid`` (its title: "tether-
    supervisor job=J attempt=A dir=STATE/run/J.A"; a step's tasks are in its session), or ""."""
    if sid not in cache:
        try:
            with open(f"/proc/{sid}/cmdline", "rb") as f:
                title = f.read().decode(errors="replace")
        except OSError:
            title = ""
        m = re.search(r" dir=(\S+)/run/", title) if title.startswith("tether-supervisor ") \
            else None
        cache[sid] = m.group(1) if m else ""
    return cache[sid]


def task_processes(work: str) -> list[tuple[int, int, int, str]]:
    """(pid, cluster job, attempt, state dir) of every live process of a job of this run (its
    environment names the work directory; the state dir is its session's supervisor's, "" if
    that is gone); a zombie's environment reads empty: dead."""
    marker = f"CC_WORK={work}".encode()
    found = []
    sessions: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if marker not in env:
            continue
        job = attempt = 0
        for item in env.split(b"\0"):
            if item.startswith(b"TETHER_CLUSTER_JOB_ID="):
                job = int(item.split(b"=", 1)[1] or 0)
            elif item.startswith(b"TETHER_CLUSTER_ATTEMPT="):
                attempt = int(item.split(b"=", 1)[1] or 0)
        if not (job and attempt):
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                sid = int(f.read().rsplit(b")", 1)[1].split()[3])
        except (OSError, IndexError, ValueError):
            sid = 0
        found.append((int(name), job, attempt, session_state(sid, sessions) if sid else ""))
    return found


class ProcWatch(threading.Thread):
    """Scans /proc every ``every`` seconds: which (job, attempt) have a live process, when."""

    def __init__(self, work: str, every: float) -> None:
        super().__init__(daemon=True)
        self.work = work
        self.every = every
        self.stop = threading.Event()
        #: (scan began, scan ended, (job, attempt) seen alive)
        self.scans: list[tuple[float, float, frozenset[tuple[int, int]]]] = []
        #: (job, attempt) -> the state directories its processes carried
        self.where: dict[tuple[int, int], set[str]] = {}
        self.begins: list[float] = []

    def run(self) -> None:
        while not self.stop.is_set():
            begun = time.time()
            seen = set()
            for _pid, job, attempt, state in task_processes(self.work):
                seen.add((job, attempt))
                self.where.setdefault((job, attempt), set()).add(state)
            self.scans.append((begun, time.time(), frozenset(seen)))
            self.stop.wait(self.every)

    def dead_by(self, key: tuple[int, int], start: float) -> float:
        """The end of the first scan begun after ``start`` that found no process of ``key``
        (inf: alive to the last scan)."""
        if len(self.begins) != len(self.scans):
            self.begins = [s[0] for s in self.scans]
        i = bisect.bisect_right(self.begins, start)
        for _begun, ended, seen in self.scans[i:]:
            if key not in seen:
                return ended
        return math.inf


class NodeWatch(threading.Thread):
    """Samples ``tether_nodes`` every ``every`` seconds: each up -> down change seen, with the
    interval it happened in and its reason."""

    def __init__(self, dsn: str, every: float) -> None:
        super().__init__(daemon=True)
        self.owner = Owner(dsn)
        self.every = every
        self.stop = threading.Event()
        self.downs: list[tuple[str, float, float, str]] = []  # (node, after, by, reason)
        self.samples = 0

    def run(self) -> None:
        last: dict[str, str] = {}
        last_at = time.time()
        while not self.stop.is_set():
            rows = self.owner.try_rows("SELECT name, state, reason FROM tether_nodes")
            now = time.time()
            if rows is not None:
                self.samples += 1
                for r in rows:
                    if r["state"] == "down" and last.get(r["name"]) == "up":
                        self.downs.append((r["name"], last_at, now, r["reason"] or ""))
                    last[r["name"]] = r["state"]
                last_at = now
            self.stop.wait(self.every)
        self.owner.close()


# ---- the cluster ----------------------------------------------------------------------------


class Agent:
    def __init__(self, name: str, base: str, secret: str, cpus: int) -> None:
        self.name = name
        self.dir = os.path.join(base, name)
        os.makedirs(self.dir)
        self.state = os.path.join(self.dir, "s")
        self.layout = Layout(self.state)
        self.secret = secret
        self.cpus = cpus
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        with open(os.path.join(self.dir, f"agent{self.starts}.log"), "wb") as out:
            self.proc = subprocess.Popen(
                [*TETHER, "agent", "--state-dir", self.state, "--cluster-file", self.secret,
                 "--node", self.name, "--heartbeat", str(HEARTBEAT), "--cpus", str(self.cpus),
                 "--oversubscribe", "--cancel-grace", "1"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def logs(self) -> list[str]:
        return sorted(glob.glob(os.path.join(self.dir, "agent*.log")))


def serving(log_path: str) -> bool:
    """Did the agent of this log get as far as serving?"""
    with open(log_path, errors="replace") as f:
        return " agent serving on " in f.read()


def last_line(log_path: str) -> str:
    with open(log_path, errors="replace") as f:
        lines = f.read().strip().splitlines()
    return lines[-1][:160] if lines else "no output"


@dataclass
class Tally:
    kills: int = 0
    sigterms: int = 0
    late_restarts: int = 0
    stops: int = 0
    stops_short: int = 0
    pg_restarts: int = 0
    takeaways: int = 0
    #: node -> (from, to) when its agent was killed, stopped or the node gone (to: beating again)
    windows: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    db_windows: list[tuple[float, float]] = field(default_factory=list)
    #: (node, agent killed or stopped at, started again or SIGCONT at, what)
    away: list[tuple[str, float, float, str]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    #: the take-away: node, its active (job, attempt, requeue) then, when all was dead, output
    taken: dict[str, Any] = field(default_factory=dict)
    harness: list[str] = field(default_factory=list)  # the bench's own failures
    submit_unanswered: int = 0  # submissions whose agent died under them (looked up, not resent)
    submit_refused: int = 0  # refused by their agent (the database away)
    submitted_by: float = 0.0  # the last submission, after t0
    harness_notes: list[str] = field(default_factory=list)  # and what it got over


class Chaos:
    def __init__(self, args: argparse.Namespace, base: str, pg: ScratchPostgres) -> None:
        self.args = args
        self.base = base
        self.pg = pg
        self.work = os.path.join(base, "w")
        self.runs = os.path.join(self.work, "runs")
        self.out = os.path.join(self.work, "out")
        os.makedirs(self.runs)
        os.makedirs(self.out)
        self.agents: dict[str, Agent] = {}
        self.roles: list[str] = []
        self.tally = Tally()
        self.lock = threading.Lock()
        self.live: set[str] = set()  # agents people may talk to now (not killed, not stopped)
        self.gone: set[str] = set()
        self.specs: list[Spec] = []
        self.ids: dict[str, int] = {}  # job name -> cluster id
        self.submit_done = threading.Event()
        self.stop = threading.Event()
        self.t0 = time.time()
        self.dsn = pg.create_db(DB)
        self.owner = Owner(self.dsn)  # the main thread's
        self.admin("init", "--heartbeat-timeout", str(TIMEOUT), "--fence-margin", str(MARGIN),
                   "--root-jobs", "allow")

    # ---- the administrator ---------------------------------------------------------------

    def admin(self, *args: str) -> str:
        res = subprocess.run([*TETHER, "cluster", *args], capture_output=True, text=True,
                             env=dict(os.environ, TETHER_CLUSTER=self.dsn), timeout=120)
        if res.returncode:
            raise SystemExit(f"tether cluster {' '.join(args)}: {res.stderr.strip()}")
        return res.stdout.strip()

    def start_agents(self) -> None:
        for name in NODES:
            secret = os.path.join(self.base, f"{name}.dsn")
            self.roles.append(f"{DB}_{name}")
            self.admin("add-node", name, "--role", f"{DB}_{name}", "--write", secret)
            self.agents[name] = Agent(name, self.base, secret, self.args.cpus)
            self.agents[name].start()
        for name in NODES:
            self.wait_beating(name, self.t0)
        self.live = set(NODES)
        self.tally.windows = {n: [] for n in NODES}

    def wait_beating(self, name: str, since: float, owner: Owner | None = None,
                     started: bool = False) -> float:
        """Wait until node ``name`` is up with a heartbeat later than ``since``; when seen.
        ``started``: its agent was just started; one that dies before it serves (the tree being
        edited by someone as it imports) is started again, up to 5 times, and that is noted."""
        owner = owner or self.owner
        deadline = time.monotonic() + 90
        retries = 0
        while True:
            rows = owner.try_rows("SELECT state, extract(epoch FROM heartbeat)::float8 AS hb "
                                  "FROM tether_nodes WHERE name = %s", (name,))
            if rows and rows[0]["state"] == "up" and rows[0]["hb"] > since:
                return time.time()
            agent = self.agents[name]
            if not agent.alive() and started and retries < 5 and not serving(agent.logs()[-1]):
                retries += 1
                self.tally.harness_notes.append(
                    f"the agent of {name} died before serving ({last_line(agent.logs()[-1])}): "
                    "started again")
                time.sleep(3)
                agent.start()
                continue
            if not agent.alive():
                raise SystemExit(f"the agent of {name} exited "
                                 f"(rc {agent.proc.returncode if agent.proc else None}; see "
                                 f"{agent.logs()[-1]})")
            if time.monotonic() > deadline:
                raise SystemExit(f"node {name} did not beat again within 90 s")
            time.sleep(0.05)

    # ---- people: submissions through a member agent ----------------------------------------

    def submission(self, spec: Spec) -> dict[str, Any]:
        args: dict[str, Any] = {
            "command": ["sh", "-c", script(spec, self.runs)], "name": spec.name, "cpus": 1,
            "gpus": 0, "memory_mb": 0, "ntasks": 1, "workdir": self.work,
            "env": {"PATH": os.environ["PATH"], "CC_WORK": self.work}, "pmi": "none",
            "umask": 0o022, "output": os.path.join(self.out, "out-%j-%N.txt")}
        if not spec.requeue:
            args["requeue"] = False
        return args

    def submit(self, spec: Spec, rng: random.Random, owner: Owner) -> None:
        """Submit once, whatever fails: a request that may have reached the database is looked
        for by its name before it is sent again."""
        while True:
            with self.lock:
                live = sorted(self.live)
            if not live:
                time.sleep(0.1)
                continue
            name = rng.choice(live)
            agent = self.agents[name]
            proc = agent.proc  # this agent, not the one the chaos may start in its place
            try:
                with Client(agent.layout.sock, timeout=60) as c:
                    self.ids[spec.name] = int(c.call("submit", self.submission(spec))["id"])
                return
            except NotListening:
                time.sleep(0.1)  # nothing was sent
                continue
            except Unreachable:
                self.tally.submit_unanswered += 1
                # Sent, no answer: its agent was killed (or stopped past the deadline). What it
                # was doing ends with it; a statement of its in flight ends within moments.
                end = time.monotonic() + 90
                while proc is not None and proc.poll() is None and time.monotonic() < end:
                    time.sleep(0.1)
                time.sleep(2)
            except TetherError:
                self.tally.submit_refused += 1
                time.sleep(0.5)  # answered: refused (the database away, say); done with it
            rows = owner.rows("SELECT id FROM tether_jobs WHERE name = %s ORDER BY id",
                              (spec.name,))
            if rows:
                self.ids[spec.name] = int(rows[0]["id"])
                return

    def submitter(self, rng: random.Random) -> None:
        owner = Owner(self.dsn)
        try:
            todo = list(self.specs)  # the take-away adds its own and submits them itself
            gap = self.args.seconds * SUBMIT_SPAN / max(1, len(todo))
            begun = time.time()
            i = 0
            while i < len(todo) and not self.stop.is_set():
                # bursts of 1-8, on a schedule: a slow submission (its agent killed under it)
                # is caught up on, so that the jobs span the chaos and not more
                self.stop.wait(max(0.0, begun + i * gap - time.time()))
                burst = rng.randint(1, 8)
                for spec in todo[i:i + burst]:
                    self.submit(spec, rng, owner)
                i += burst
            self.tally.submitted_by = time.time() - self.t0
        except BaseException as exc:  # noqa: BLE001 - said, and the run fails
            self.tally.harness.append(f"submitter: {exc!r}")
            self.stop.set()
        finally:
            owner.close()
            self.submit_done.set()

    # ---- chaos ------------------------------------------------------------------------------

    def chaos(self, rng: random.Random) -> None:
        owner = Owner(self.dsn)
        try:
            self.chaos_loop(rng, owner)
        except BaseException as exc:  # noqa: BLE001 - said, and the run fails
            self.tally.harness.append(f"chaos: {exc!r}")
            self.stop.set()
        finally:
            owner.close()

    def minimums(self) -> dict[str, tuple[int, int]]:
        t = self.tally
        return {"kill": (t.kills, self.args.min_kills), "stop": (t.stops, self.args.min_stops),
                "pg": (t.pg_restarts, self.args.min_pg_restarts)}

    def chaos_loop(self, rng: random.Random, owner: Owner) -> None:
        seconds = self.args.seconds
        take_at = rng.uniform(0.25, 0.55) * seconds
        while not self.stop.is_set():
            elapsed = time.time() - self.t0
            short = [k for k, (done, want) in self.minimums().items() if done < want]
            if elapsed >= seconds and not short and self.tally.takeaways \
                    and self.submit_done.is_set():
                return
            if elapsed > 4 * seconds:
                self.tally.harness.append("the minimum chaos was not done in 4 x --seconds")
                return
            if self.stop.wait(rng.uniform(*self.args.every)):
                return
            if not self.tally.takeaways and time.time() - self.t0 >= take_at:
                self.take_away(rng, owner)
                continue
            if short and rng.random() < 0.6:
                kind = rng.choice(short)
            else:
                kind = rng.choices(("kill", "stop", "pg"), weights=(0.55, 0.27, 0.18))[0]
            with self.lock:
                candidates = sorted(self.live)
            node = rng.choice(candidates)
            if kind == "kill":
                self.kill(node, rng, owner)
            elif kind == "stop":
                self.sigstop(node, rng, owner)
            else:
                self.pg_restart(rng, owner)

    def say(self, what: str) -> None:
        line = f"t+{time.time() - self.t0:6.1f}s {what}"
        self.tally.events.append(line)
        if self.args.verbose:
            log(line)

    def kill(self, node: str, rng: random.Random, owner: Owner) -> None:
        agent = self.agents[node]
        assert agent.proc is not None
        sig = signal.SIGTERM if rng.random() < 0.15 else signal.SIGKILL
        late = rng.random() < 0.15
        with self.lock:
            self.live.discard(node)
        began = time.time()
        agent.proc.send_signal(sig)
        agent.proc.wait(60)
        if late:  # dead past the timeout and margin: its steps fence, the node is declared down
            time.sleep(TIMEOUT + MARGIN + rng.uniform(0.5, 2.0))
        restarted = time.time()
        agent.start()
        back = self.wait_beating(node, restarted, owner, started=True)
        self.tally.windows[node].append((began, back))
        self.tally.away.append((node, began, restarted, signal.Signals(sig).name))
        self.tally.kills += 1
        self.tally.sigterms += sig == signal.SIGTERM
        self.tally.late_restarts += late
        self.say(f"{signal.Signals(sig).name} agent {node}, restarted after "
                 f"{restarted - began:.1f}s, beating after {back - began:.1f}s")
        with self.lock:
            self.live.add(node)

    def sigstop(self, node: str, rng: random.Random, owner: Owner) -> None:
        agent = self.agents[node]
        assert agent.proc is not None
        short = rng.random() < 0.3
        length = (rng.uniform(TIMEOUT + 0.3, TIMEOUT + MARGIN - 0.3) if short
                  else TIMEOUT + MARGIN + rng.uniform(0.5, 3.0))
        with self.lock:
            self.live.discard(node)
        began = time.time()
        agent.proc.send_signal(signal.SIGSTOP)
        time.sleep(length)
        agent.proc.send_signal(signal.SIGCONT)
        cont = time.time()
        back = self.wait_beating(node, cont, owner)
        self.tally.windows[node].append((began, back))
        self.tally.away.append((node, began, cont, "SIGSTOP"))
        self.tally.stops += 1
        self.tally.stops_short += short
        self.say(f"SIGSTOP agent {node} for {cont - began:.1f}s, beating "
                 f"{back - cont:.1f}s after SIGCONT")
        with self.lock:
            self.live.add(node)

    def pg_restart(self, rng: random.Random, owner: Owner) -> None:
        owner.close()
        began = time.time()
        self.pg.stop()
        time.sleep(TIMEOUT + rng.uniform(1.0, 4.0))
        self.pg.start()
        up = time.time()
        self.tally.db_windows.append((began, up))
        self.tally.pg_restarts += 1
        with self.lock:
            live = sorted(self.live)
        for node in live:
            self.wait_beating(node, up, owner)
        self.say(f"PostgreSQL down for {up - began:.1f}s; every node beating "
                 f"{time.time() - up:.1f}s after")

    def take_away(self, rng: random.Random, owner: Owner) -> None:
        """A node goes for good: one running a --no-requeue job; its agent and every process of
        its steps killed (seen gone), then confirmed dead by the administrator."""
        for _ in range(2):  # so that some node runs a --no-requeue job now
            spec = Spec(len(self.specs), f"cc-{len(self.specs)}", 20.0, 0, requeue=False)
            self.specs.append(spec)
            self.submit(spec, rng, owner)
        deadline = time.monotonic() + 60
        victim = None
        while victim is None:
            with self.lock:
                live = sorted(self.live)
            rows = owner.rows("SELECT id, attempt, node FROM tether_jobs WHERE state = "
                              "'running' AND NOT requeue AND node = ANY(%s) ORDER BY id",
                              (live,))
            for r in rows:  # one whose run has begun (its start marker is written)
                if any(run.attempt == r["attempt"] and run.kind == "start"
                       for run in read_markers(self.runs, r["id"])):
                    victim = str(r["node"])
                    break
            if victim is None:
                if time.monotonic() > deadline:
                    raise SystemExit("no node ran a --no-requeue job to take away")
                time.sleep(0.1)
        agent = self.agents[victim]
        assert agent.proc is not None
        with self.lock:
            self.live.discard(victim)
        began = time.time()
        agent.proc.send_signal(signal.SIGCONT)
        agent.proc.kill()
        agent.proc.wait(60)
        # What it ran, as the database knows it (the agent is dead: this cannot change now).
        active = owner.rows("SELECT id, attempt, requeue FROM tether_jobs WHERE node = %s AND "
                            "state = ANY(%s) ORDER BY id", (victim, list(ACTIVE)))
        keys = {(int(r["id"]), int(r["attempt"])) for r in active}
        if self.args.check_the_checker:
            # The administrator's lie the docs warn of: confirmed dead while its steps still
            # run (until they fence themselves, a timeout later). Jobs run twice: the
            # analysis must say so.
            self.admin("node-down", victim, "--confirm-dead")
            time.sleep(TIMEOUT + 1.0)
        sessions: set[int] = set()
        quiet = 0
        while quiet < 3:  # three scans in a row with nothing of it left
            killed = kill_tree(agent.state, sessions)
            left = naming(agent.state) + [p for p, j, a, st in task_processes(self.work)
                                          if st == agent.state or (j, a) in keys]
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            quiet = quiet + 1 if not killed and not left else 0
            if time.time() - began > 60:
                raise SystemExit(f"node {victim}'s processes would not die: {left}")
            time.sleep(0.05)
        dead = time.time()
        said = self.admin("node-down", victim, "--confirm-dead")
        self.tally.windows[victim].append((began, math.inf))
        self.gone.add(victim)
        self.tally.takeaways += 1
        self.tally.taken = {"node": victim, "active": [(int(r["id"]), int(r["attempt"]),
                                                         bool(r["requeue"])) for r in active],
                            "dead_at": dead, "confirmed_at": time.time(), "said": said}
        self.say(f"node {victim} taken away (everything dead after {dead - began:.1f}s; active "
                 f"then {[(r['id'], r['attempt']) for r in active]}); node-down: {said}")

    # ---- the end --------------------------------------------------------------------------

    def calm(self) -> None:
        """Every job final, then every task of them gone (or the time is up)."""
        deadline = time.monotonic() + self.args.drain
        while time.monotonic() < deadline:
            names = [s.name for s in self.specs]
            rows = self.owner.rows("SELECT count(*) AS n FROM tether_jobs WHERE name = ANY(%s) "
                                   "AND state = ANY(%s)", (names, list(FINAL)))
            if rows[0]["n"] >= len(names) and len(self.ids) == len(names):
                break
            time.sleep(0.5)
        while time.monotonic() < deadline and task_processes(self.work):
            time.sleep(0.2)

    def close(self) -> None:
        """Everything this run started, whatever failed: agents (SIGCONT first: one may be
        stopped), their templates, supervisors and tasks (by state directory, session and
        cgroup), then the database and the nodes' roles."""
        try:
            self.owner.close()
            for agent in self.agents.values():
                if agent.alive():
                    assert agent.proc is not None
                    agent.proc.send_signal(signal.SIGCONT)
                    agent.proc.kill()
                    agent.proc.wait()
            for _ in range(50):
                if not kill_tree(self.base) and not naming(self.base) \
                        and not task_processes(self.work):
                    break
                for pid in naming(self.base) + [p[0] for p in task_processes(self.work)]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
        finally:
            try:
                self.pg.drop_db(DB)
                self.pg.drop_roles(*self.roles, ("tether_node_" + DB)[:63])
            except psycopg.Error as exc:
                log(f"dropping the database and roles failed: {exc}")


# ---- reading what happened ---------------------------------------------------------------------


@dataclass
class Marker:
    kind: str
    node: str
    job: int
    attempt: int
    at: float
    code: int | None


def read_markers(runs: str, job: int) -> list[Marker]:
    try:
        with open(os.path.join(runs, str(job))) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        try:
            if parts[0] == "start" and len(parts) == 5:
                out.append(Marker("start", parts[1], int(parts[2]), int(parts[3]),
                                  float(parts[4]), None))
            elif parts[0] == "end" and len(parts) == 6:
                out.append(Marker("end", parts[1], int(parts[2]), int(parts[3]),
                                  float(parts[4]), int(parts[5])))
        except (ValueError, IndexError):
            continue
    return out


@dataclass
class Run:
    job: int
    attempt: int
    node: str
    start: float
    end: float | None = None
    code: int | None = None
    bound: float = math.inf
    how: str = ""


def log_time(line: str) -> float | None:
    m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ", line)
    if m is None:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + \
        int(m.group(2)) / 1000


def declarations(ch: Chaos, watch: NodeWatch) -> list[dict[str, Any]]:
    """Every node declared down that was seen: the node, the reason, and the earliest and
    latest moment it can have happened. One declaration is seen by up to three witnesses (a
    sample of the nodes' rows, its lost attempts' rows, the declaring agent's log line), told
    apart by node, reason and time: two of one node are at least the timeout and margin apart
    (it must have beaten again in between), and two may well have the same reason text."""
    found: list[dict[str, Any]] = []

    def add(node: str, reason: str, lo: float, hi: float, source: str) -> None:
        for d in found:
            if d["node"] == node and d["reason"] == reason and lo <= d["hi"] + 1.5 \
                    and hi >= d["lo"] - 1.5:
                if hi - lo < d["hi"] - d["lo"]:
                    d["lo"], d["hi"] = lo, hi
                d["sources"].add(source)
                return
        found.append({"node": node, "reason": reason, "lo": lo, "hi": hi,
                      "sources": {source}})

    for node, lo, hi, reason in watch.downs:
        add(node, reason, lo, hi, "sampled")
    for r in ch.owner.rows("SELECT node, reason, extract(epoch FROM ended_at)::float8 AS t "
                           "FROM tether_attempts WHERE state = 'lost' AND (reason LIKE "
                           "'%missed its heartbeats%' OR reason LIKE '%confirmed dead%') "
                           "ORDER BY ended_at"):
        add(r["node"], r["reason"], r["t"], r["t"], "lost attempts")
    pat = re.compile(r"(node (\S+) missed its heartbeats .*?; declared down by \S+): requeued")
    for agent in ch.agents.values():
        for path in agent.logs():
            with open(path, errors="replace") as f:
                for line in f:
                    m = pat.search(line)
                    t = log_time(line)
                    if m and t is not None:
                        add(m.group(2), m.group(1), t - 1.0, t, "agent log")
    return found


def analyse(ch: Chaos, procs: ProcWatch, watch: NodeWatch) -> tuple[
        dict[str, Any], dict[str, list[str]], list[str]]:
    """The figures, the problems by kind, and notes (each node declared down)."""
    notes: list[str] = []
    bad: dict[str, list[str]] = {k: [] for k in (
        "overlapping", "lost", "twice", "wrongly_down", "no_requeue", "wrong", "leaked")}
    jobs = ch.owner.rows("SELECT id, name, state, attempt, node, exit_code, signal, reason, "
                         "requeue, ended_at FROM tether_jobs ORDER BY id")
    attempts: dict[int, list[dict[str, Any]]] = {}
    for a in ch.owner.rows("SELECT job, attempt, node, state, reason FROM tether_attempts "
                           "ORDER BY job, attempt"):
        attempts.setdefault(int(a["job"]), []).append(a)
    states = {a.state: n for n, a in ch.agents.items()}
    by_name: dict[str, list[dict[str, Any]]] = {}
    for j in jobs:
        by_name.setdefault(j["name"], []).append(j)
    runs_total = killed = 0
    for spec in ch.specs:
        rows = by_name.get(spec.name, [])
        if not rows:
            bad["lost"].append(f"{spec.name}: never recorded")
            continue
        if len(rows) > 1:
            bad["wrong"].append(f"{spec.name}: submitted {len(rows)} times "
                                f"(jobs {[r['id'] for r in rows]})")
        for j in rows:
            jid = int(j["id"])
            where = f"job {jid} ({spec.name}{'' if spec.requeue else ', --no-requeue'})"
            # -- the runs, from the markers; a killed run's end from /proc
            runs: dict[tuple[int, int], Run] = {}
            for m in read_markers(ch.runs, jid):
                key = (m.job, m.attempt)
                if m.kind == "start":
                    if key in runs:
                        bad["overlapping"].append(f"{where}: attempt {m.attempt} started twice "
                                                  f"(on {runs[key].node} and {m.node})")
                        continue
                    runs[key] = Run(m.job, m.attempt, m.node, m.at)
                elif key in runs:
                    runs[key].end, runs[key].code = m.at, m.code
                else:
                    bad["wrong"].append(f"{where}: an end marker of attempt {m.attempt} with "
                                        "no start")
            for key, run in runs.items():
                runs_total += 1
                if run.end is not None:
                    run.bound, run.how = run.end, "ended"
                else:
                    killed += 1
                    run.bound = procs.dead_by(key, run.start)
                    run.how = "seen dead" if run.bound < math.inf else "alive at the end"
                carried = {states.get(s, s) for s in procs.where.get(key, set()) if s}
                if carried and carried != {run.node}:
                    bad["wrong"].append(f"{where}: attempt {run.attempt}'s marker names node "
                                        f"{run.node}, its tasks were node(s) {sorted(carried)}'s")
            ordered = sorted(runs.values(), key=lambda r: r.start)
            for i, later in enumerate(ordered):
                for earlier in ordered[:i]:
                    if later.start < earlier.bound:
                        bad["overlapping"].append(
                            f"{where}: attempt {later.attempt} on {later.node} started at "
                            f"{later.start - ch.t0:.3f}s, attempt {earlier.attempt} on "
                            f"{earlier.node} (started {earlier.start - ch.t0:.3f}s) "
                            f"{earlier.how} at {earlier.bound - ch.t0:.3f}s: overlap "
                            f"{min(earlier.bound, later.bound) - later.start:.3f}s")
            # -- the job's end
            if j["state"] not in FINAL or j["state"] == "lost":
                bad["lost"].append(f"{where}: {j['state']} ({j['reason']})")
                continue
            tries = attempts.get(jid, [])
            finals = [a for a in tries if a["state"] in FINAL and a["state"] != "lost"]
            if len(finals) > 1:
                bad["twice"].append(f"{where}: {len(finals)} results: " + "; ".join(
                    f"attempt {a['attempt']} on {a['node']} {a['state']}" for a in finals))
            last = tries[-1] if tries else None
            if last is None or last["attempt"] != j["attempt"] or last["state"] != (
                    "lost" if j["state"] == "node_fail" else j["state"]):
                bad["twice"].append(f"{where}: ended {j['state']} at attempt {j['attempt']}, "
                                    f"its last attempt row is {last}")
            if j["state"] == "node_fail":
                if spec.requeue:
                    bad["wrong"].append(f"{where}: node_fail though requeued on node loss "
                                        f"({j['reason']})")
            elif (j["state"], j["exit_code"], j["signal"]) != (spec.state, spec.code, None):
                bad["wrong"].append(f"{where}: {j['state']} exit {j['exit_code']} signal "
                                    f"{j['signal']}, expected {spec.state} exit {spec.code} "
                                    f"({j['reason']})")
            else:
                final = runs.get((jid, int(j["attempt"])))
                if final is None or final.end is None or final.node != j["node"] \
                        or final.code != j["exit_code"]:
                    bad["wrong"].append(f"{where}: {j['state']} at attempt {j['attempt']} on "
                                        f"{j['node']}, but no run of it ended so: {final}")
            after = [r for r in runs.values() if r.attempt > int(j["attempt"])]
            if after:
                bad["wrong"].append(f"{where}: ran after its final attempt {j['attempt']}: "
                                    f"{[(r.attempt, r.node) for r in after]}")
    # -- --no-requeue jobs of the node taken away
    taken = ch.tally.taken
    exercised = 0
    if taken:
        by_id = {int(j["id"]): j for j in jobs}
        for jid, attempt, requeue in taken["active"]:
            if requeue:
                continue
            exercised += 1
            j = by_id[jid]
            again = [m for m in read_markers(ch.runs, jid)
                     if m.kind == "start" and (m.attempt > attempt or m.at > taken["dead_at"])]
            if j["state"] != "node_fail" or int(j["attempt"]) != attempt or again:
                bad["no_requeue"].append(
                    f"job {jid} (--no-requeue, attempt {attempt} on {taken['node']} taken away):"
                    f" ended {j['state']} at attempt {j['attempt']} ({j['reason']}); runs after:"
                    f" {[(m.attempt, m.node) for m in again]}")
    if not exercised:
        bad["no_requeue"].append("no --no-requeue job was running on the node taken away")
    # -- nodes declared down
    decl = declarations(ch, watch)
    lookback = TIMEOUT + MARGIN + SLACK
    for d in sorted(decl, key=lambda d: float(d["hi"])):
        node, reason = d["node"], d["reason"]
        wins = [(a, b) for a, b in ch.tally.windows.get(node, [])
                if a <= d["hi"] and b >= d["lo"] - lookback]
        notes.append(f"t+{d['lo'] - ch.t0:.1f}..{d['hi'] - ch.t0:.1f}s node {node} down "
                     f"({', '.join(sorted(d['sources']))}): {reason[:110]}"
                     + (f" [its agent away from t+{wins[0][0] - ch.t0:.1f}s]" if wins else ""))
        if wins:
            continue
        db = [(round(a - ch.t0, 1), round(b - ch.t0, 1)) for a, b in ch.tally.db_windows
              if a <= d["hi"] and b >= d["lo"] - lookback]
        bad["wrongly_down"].append(
            f"node {node} declared down between t+{d['lo'] - ch.t0:.2f}s and "
            f"t+{d['hi'] - ch.t0:.2f}s ({'; '.join(sorted(d['sources']))}): {reason}; its agent"
            f" was neither killed nor stopped in the {lookback:g}s before"
            + (f"; a PostgreSQL outage overlapped it ({db})" if db else ""))
    # -- nodes away past the timeout and margin while another judged, never declared down:
    # not a safety matter (their steps fenced themselves), a slow failover; said, not failed
    late = []
    for node, began, returned, what in ch.tally.away:
        if returned - began < TIMEOUT + MARGIN + 1.0:
            continue
        judges = [n for n in NODES if n != node and not any(
            a <= returned and b >= began - TIMEOUT for a, b in ch.tally.windows.get(n, []))]
        outage = any(a <= returned and b >= began - TIMEOUT - MARGIN
                     for a, b in ch.tally.db_windows)
        if not judges or outage:
            continue
        if not any(d["node"] == node and began <= d["hi"] and d["lo"] <= returned + SLACK
                   for d in decl):
            late.append(f"node {node}: its agent {what} at t+{began - ch.t0:.1f}s, back at "
                        f"t+{returned - ch.t0:.1f}s, not declared down meanwhile though "
                        f"{', '.join(judges)} beat all along")
    notes += late
    # -- tasks left
    for pid, jid, attempt, state in task_processes(ch.work):
        bad["leaked"].append(f"pid {pid}: job {jid} attempt {attempt} on "
                             f"{states.get(state, state)}")
    ends = [e for j in jobs if (e := stamps.epoch(j["ended_at"])) is not None]
    elapsed = (max(ends) if ends else time.time()) - ch.t0
    t = ch.tally
    figures: dict[str, Any] = {
        "seed": ch.args.seed, "jobs": len(ch.specs), "seconds": round(elapsed, 1),
        "jobs_per_s": round(len(ch.specs) / elapsed, 2) if elapsed > 0 else 0.0,
        "submitted_over_s": round(t.submitted_by, 1),
        "submits_unanswered": t.submit_unanswered, "submits_refused": t.submit_refused,
        "agent_kills": t.kills, "of_them_sigterm": t.sigterms,
        "of_them_restarted_late": t.late_restarts, "agent_sigstops": t.stops,
        "of_them_under_margin": t.stops_short, "postgres_restarts": t.pg_restarts,
        "nodes_taken_away": t.takeaways, "runs": runs_total, "runs_killed": killed,
        "requeued_jobs": sum(1 for j in jobs if j["attempt"] > 1),
        "node_fail_jobs": sum(1 for j in jobs if j["state"] == "node_fail"),
        "declared_down": len(decl), "not_declared_down_in_time": len(late),
        "no_requeue_taken_away": exercised,
        "overlapping_runs": len(bad["overlapping"]), "lost": len(bad["lost"]),
        "results_twice": len(bad["twice"]), "wrongly_declared_down": len(bad["wrongly_down"]),
        "no_requeue_failures": len(bad["no_requeue"]), "wrong": len(bad["wrong"]),
        "leaked": len(bad["leaked"]), "proc_scans": len(procs.scans),
        "node_samples": watch.samples,
    }
    return figures, bad, notes


# ---- main ------------------------------------------------------------------------------------


def keep_logs(ch: Chaos, pg: ScratchPostgres) -> str:
    """A failed run's evidence (logs, markers, events), copied out before the rest goes."""
    keep = tempfile.mkdtemp(dir="/tmp", prefix="tether-cluster-chaos-logs-")
    for name, agent in ch.agents.items():
        for path in agent.logs():
            shutil.copy(path, os.path.join(keep, f"{name}-{os.path.basename(path)}"))
        sup = os.path.join(agent.state, "supervisors.log")
        if os.path.exists(sup):
            shutil.copy(sup, os.path.join(keep, f"{name}-supervisors.log"))
    shutil.copytree(ch.runs, os.path.join(keep, "runs"))
    if os.path.exists(pg.log):
        shutil.copy(pg.log, os.path.join(keep, "postgres.log"))
    with open(os.path.join(keep, "events.txt"), "w") as f:
        f.write(f"t0 = {ch.t0:.3f} (epoch)\n" + "\n".join(ch.tally.events) + "\n")
    return keep


def run(args: argparse.Namespace) -> int:
    for var in ("TETHER_CLUSTER", "TETHER_STATE_DIR"):  # only the admin's commands get a DSN
        os.environ.pop(var, None)
    secs = args.seconds
    args.min_kills = args.min_kills if args.min_kills is not None else max(3, int(secs / 16))
    args.min_stops = args.min_stops if args.min_stops is not None else max(2, int(secs / 48))
    args.min_pg_restarts = args.min_pg_restarts if args.min_pg_restarts is not None \
        else max(1, int(secs / 60))
    rng = random.Random(args.seed)
    base = tempfile.mkdtemp(dir="/tmp", prefix="tcc")
    pg = ScratchPostgres()
    ch: Chaos | None = None
    procs = watch = None
    figures: dict[str, Any] = {}
    bad: dict[str, list[str]] = {}
    notes: list[str] = []
    kept = ""
    try:
        pg.start()
        ch = Chaos(args, base, pg)
        ch.specs = [make_spec(i, rng) for i in range(args.jobs)]
        procs = ProcWatch(ch.work, args.scan)
        procs.start()
        ch.start_agents()
        watch = NodeWatch(ch.dsn, 0.1)
        watch.start()
        log(f"3 agents up; {args.jobs} jobs over ~{secs * SUBMIT_SPAN:.0f}s, chaos for {secs:g}s")
        ch.t0 = time.time()
        sub = threading.Thread(target=ch.submitter, args=(random.Random(args.seed + 1),),
                               daemon=True)
        cha = threading.Thread(target=ch.chaos, args=(random.Random(args.seed + 2),),
                               daemon=True)
        sub.start()
        cha.start()
        cha.join()
        ch.submit_done.wait()
        log("chaos over: letting every job end" + (
            f" (harness: {ch.tally.harness})" if ch.tally.harness else ""))
        if not ch.tally.harness:
            ch.calm()
        watch.stop.set()
        watch.join()
        procs.stop.set()
        procs.join()
        figures, bad, notes = analyse(ch, procs, watch)
        if any(bad.values()) or ch.tally.harness or args.keep:
            kept = keep_logs(ch, pg)
    finally:
        if procs is not None:
            procs.stop.set()
        if watch is not None:
            watch.stop.set()
        if ch is not None:
            ch.close()
        pg.cleanup()
        shutil.rmtree(base, ignore_errors=True)
    assert ch is not None
    short = [f"{k}: {done} < {want}" for k, (done, want) in ch.minimums().items() if done < want]
    problems = [*ch.tally.harness, *(f"too little chaos ({s})" for s in short)]
    for key in ("overlapping", "lost", "twice", "wrongly_down", "no_requeue", "wrong",
                "leaked"):
        problems += [f"[{key}] {p}" for p in bad.get(key, [])]
    ok = not problems
    counts = (f"overlapping runs {figures.get('overlapping_runs')}, lost {figures.get('lost')}, "
              f"results twice {figures.get('results_twice')}, wrongly declared down "
              f"{figures.get('wrongly_declared_down')}, no-requeue on the node taken away "
              f"{'ok' if not bad.get('no_requeue') else 'FAILED'}")
    verdict = ("PASS: " if ok else "FAIL: ") + counts
    if args.json:
        print(json.dumps({**figures, "ok": ok, "verdict": verdict, "problems": problems,
                          "events": ch.tally.events, "taken_away": ch.tally.taken.get("node"),
                          "declared_down_nodes": notes, "harness_notes": ch.tally.harness_notes,
                          "logs": kept or None}))
        return 0 if ok else 1
    for line in ch.tally.events:
        print(f"  {line}")
    for line in notes + ch.tally.harness_notes:
        print(f"  {line}")
    for key, value in figures.items():
        print(f"{key:>24}: {value}")
    for p in problems[:60]:
        print(f"  - {p}")
    if len(problems) > 60:
        print(f"  ... and {len(problems) - 60} more")
    if kept:
        print(f"logs, markers and events kept in {kept}")
    print(verdict)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=400)
    p.add_argument("--seconds", type=float, default=240.0,
                   help="chaos at least this long (jobs are submitted over 85%% of it; the "
                        "chaos goes on until the last is in)")
    p.add_argument("--min-kills", type=int, help="agent kills at least (default seconds/16)")
    p.add_argument("--min-stops", type=int,
                   help="SIGSTOPs past the timeout at least (default seconds/48, >= 2)")
    p.add_argument("--min-pg-restarts", type=int,
                   help="PostgreSQL restarts at least (default seconds/60, >= 1)")
    p.add_argument("--every", type=float, nargs=2, default=(2.0, 5.0), metavar=("MIN", "MAX"),
                   help="seconds between chaos events (uniform)")
    p.add_argument("--scan", type=float, default=0.05, help="seconds between /proc scans")
    p.add_argument("--drain", type=float, default=180.0,
                   help="seconds allowed after the chaos for every job to end")
    p.add_argument("--cpus", type=int, default=4, help="CPUs of each agent")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--verbose", action="store_true", help="say each chaos event as it happens")
    p.add_argument("--check-the-checker", action="store_true",
                   help="confirm the node taken away dead *before* killing its steps: jobs then "
                        "run twice, and the run must FAIL with overlapping runs (a test of this "
                        "bench's own analysis)")
    p.add_argument("--keep", action="store_true",
                   help="keep the logs, markers and events even when the run passes")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
