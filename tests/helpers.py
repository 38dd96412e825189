"""Driving real agents, supervisors and jobs from tests: processes, signals and files."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tether.agent import contain
from tether.shared import framing, protocol, records
from tether.shared.paths import Layout, RunDir
from tether.shared.procid import ProcId, all_processes, proc_stat

T = TypeVar("T")

CLI = [sys.executable, "-m", "tether.cli.main"]


def default_output(work: str, job: int) -> str:
    """Where a job's output goes by default: ``tether-NODE-ID.out`` (the node name defaults to
    the host name), or ``tether-ID.out`` for a job an older release submitted."""
    current = os.path.join(work, f"tether-{socket.gethostname()}-{job}.out")
    older = os.path.join(work, f"tether-{job}.out")
    return older if os.path.exists(older) and not os.path.exists(current) else current


def poll_until(predicate: Callable[[], T], timeout: float, what: str,
               interval: float = 0.02) -> T:
    """Poll ``predicate`` until it is truthy; fail naming ``what`` if it never is."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


_FOREIGN: tuple[list[str], dict[str, str]] | None = None
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def foreign_python() -> tuple[list[str], dict[str, str]]:
    """An interpreter command and environment that *other* users can run tether's code with.

    Usually the venv itself works (its interpreter is Debian's python). Where the checkout lies
    under a directory other users cannot enter, the packages tether's clients need are copied
    once to a world-readable temporary directory and run with /usr/bin/python3.
    """
    global _FOREIGN
    if _FOREIGN is not None:
        return _FOREIGN
    try:
        probe = subprocess.run([sys.executable, "-c",
                                "import tether.shared.client, tether.cli.main, zmq"],
                               user="nobody", cwd="/", capture_output=True,
                               env={"PATH": "/usr/bin:/bin", "PYTHONPATH": _ROOT})
        usable = probe.returncode == 0
    except OSError:  # the interpreter's own path is out of other users' reach
        usable = False
    if usable:
        _FOREIGN = ([sys.executable], {"PYTHONPATH": _ROOT})
        return _FOREIGN
    import atexit
    import importlib.util

    copy = tempfile.mkdtemp(dir="/tmp", prefix="ttpy")
    atexit.register(shutil.rmtree, copy, True)
    # the links in tether/ are followed: the copy holds real files
    shutil.copytree(os.path.join(_ROOT, "tether"), os.path.join(copy, "tether"))
    site = os.path.dirname(os.path.dirname(importlib.util.find_spec("zmq").origin or ""))
    for name in os.listdir(site):
        if name.split(".")[0] in ("zmq", "pyzmq", "msgpack"):
            src = os.path.join(site, name)
            if os.path.isdir(src):
                shutil.copytree(src, os.path.join(copy, name))
    for dirpath, _dirs, filenames in os.walk(copy):
        os.chmod(dirpath, 0o755)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o755)
    _FOREIGN = (["/usr/bin/python3"], {"PYTHONPATH": copy})
    return _FOREIGN


class RawDoor:
    """A bare door connection: sends exactly the bytes given, reads whole reply frames."""

    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.deframer = framing.Deframer()

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, payload: bytes) -> None:
        self.sock.sendall(framing.HEADER.pack(len(payload)) + payload)

    def reply(self, what: str = "a request") -> protocol.Reply:
        while (payload := self.deframer.next()) is None:
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                raise AssertionError(f"no reply to {what} in time") from None
            if not data:
                raise AssertionError(f"connection closed before the reply to {what}")
            self.deframer.feed(data)
        return protocol.decode_reply(payload)

    def close(self) -> None:
        self.sock.close()


def pid_alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and not st.dead


class Node:
    """One state directory, its agent (restartable) and everything they start."""

    def __init__(self, cpus: int = 4, extra: list[str] | None = None) -> None:
        self.dir = tempfile.mkdtemp(dir="/tmp", prefix="tt")
        self.state = os.path.join(self.dir, "s")
        self.work = os.path.join(self.dir, "w")
        os.makedirs(self.work)
        self.layout = Layout(self.state)
        self.args = ["--cpus", str(cpus), "--cancel-grace", "2", *(extra or [])]
        if cpus > len(os.sched_getaffinity(0)):  # a bigger node than this machine: say so
            self.args.append("--oversubscribe")
        # TETHER_TEST_CGROUP=none runs a suite with cgroups hidden (the degrade path)
        if os.environ.get("TETHER_TEST_CGROUP"):
            self.args += ["--cgroup", os.environ["TETHER_TEST_CGROUP"]]
        self.agent: subprocess.Popen[bytes] | None = None
        self.agent_logs: list[str] = []
        self.env = dict(os.environ, TETHER_STATE_DIR=self.state)
        #: the tether command this node's agent and CLI calls run (another build's, in skew tests)
        self.tether = list(CLI)

    # ---- the agent -------------------------------------------------------------------------

    def start(self, env: dict[str, str] | None = None, wait: bool = True) -> None:
        assert self.agent is None or self.agent.poll() is not None, "agent already running"
        log = os.path.join(self.dir, f"agent{len(self.agent_logs)}.log")
        self.agent_logs.append(log)
        with open(log, "wb") as out:
            self.agent = subprocess.Popen(
                [*self.tether, "agent", "--state-dir", self.state,
                 # releases before 0.5.0 neither know nor need --oversubscribe
                 *(a for a in self.args if self.tether == CLI or a != "--oversubscribe")],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(self.env, **(env or {})), start_new_session=True,
            )
        if wait:
            poll_until(lambda: self.agent_answers(), 20, "the agent to answer `status`")

    def agent_answers(self) -> bool:
        assert self.agent is not None
        if self.agent.poll() is not None:
            raise AssertionError(f"agent exited with {self.agent.returncode}: {self.logs()}")
        return self.cli("status").returncode == 0

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.agent is not None
        self.agent.send_signal(sig)
        rc = self.agent.wait(timeout=20)
        return rc

    def logs(self) -> str:
        out = []
        for path in [*self.agent_logs, os.path.join(self.state, "supervisors.log")]:
            try:
                with open(path) as f:
                    out.append(f"--- {path}\n{f.read()[-6000:]}")
            except FileNotFoundError:
                pass
        return "\n".join(out)

    # ---- the CLI ---------------------------------------------------------------------------

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.tether, *args], capture_output=True, text=True,
                              env=self.env, cwd=self.work, timeout=timeout)

    def ok(self, *args: str) -> str:
        res = self.cli(*args)
        assert res.returncode == 0, f"tether {' '.join(args)}: rc={res.returncode} " \
                                    f"{res.stderr}\n{self.logs()}"
        return res.stdout

    def submit(self, *command: str, opts: tuple[str, ...] = ()) -> int:
        return int(self.ok("submit", *opts, "--", *command).strip())

    def job(self, job_id: int) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.ok("show", str(job_id), "--json"))
        return result

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.ok("status", "--json"))
        return result

    def wait_state(self, job_id: int, states: tuple[str, ...], timeout: float = 30) -> dict[
            str, Any]:
        return poll_until(lambda: (j := self.job(job_id))["state"] in states and j, timeout,
                          f"job {job_id} to reach {states}")

    def wait_end(self, job_id: int, timeout: float = 60) -> dict[str, Any]:
        res = self.cli("wait", str(job_id), "--timeout", str(timeout), timeout=timeout + 30)
        assert res.returncode != 124, f"job {job_id} did not end in {timeout}s\n{self.logs()}"
        return self.job(job_id)

    def end_while_down_then_kill_supervisor(self, exit_code: int) -> RunDir:
        """Run ``exit CODE`` to its exit record with the agent SIGKILLed, then SIGKILL the
        supervisor before anyone acknowledged it: only the sentinel knows the result."""
        self.start()
        job = self.submit("sh", "-c", f"sleep 0.5; exit {exit_code}")
        self.wait_state(job, ("running",))
        rd = self.layout.run_dir(job, 1)
        self.stop(signal.SIGKILL)
        poll_until(lambda: os.path.exists(rd.sentinel), 30, "the exit record")
        sup = ProcId.from_dict(records.read_manifest(rd.manifest)["supervisor"])
        os.kill(sup.pid, signal.SIGKILL)
        poll_until(lambda: not sup.alive(), 10, "the supervisor to die")
        return rd

    # ---- what is on disk and in /proc -------------------------------------------------------

    def manifest(self, job_id: int, attempt: int = 1) -> dict[str, Any]:
        return records.read_manifest(self.layout.run_dir(job_id, attempt).manifest)

    def running_manifest(self, job_id: int, attempt: int = 1) -> dict[str, Any]:
        def get() -> dict[str, Any] | None:
            try:
                m = self.manifest(job_id, attempt)
            except (FileNotFoundError, records.RecordError):
                return None
            return m if m["phase"] == "running" else None
        return poll_until(get, 30, f"job {job_id} manifest phase=running")

    def supervisor_pids(self) -> list[int]:
        """Every live supervisor of this state dir, found from /proc (not from the agent)."""
        found = []
        for st in all_processes():
            if st.dead:
                continue
            try:
                with open(f"/proc/{st.pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            # the title: "tether-supervisor job=J attempt=A dir=<state>/run/J.A"
            if (cmdline.startswith(b"tether-supervisor ")
                    and b" dir=" + self.state.encode() + b"/run/" in cmdline):
                found.append(st.pid)
        return found

    def template_pids(self) -> list[int]:
        """The live supervisor template(s) of this state dir (title "tether-template dir=D")."""
        found = []
        title = b"tether-template dir=" + self.state.encode()
        for st in all_processes():
            if st.dead:
                continue
            try:
                with open(f"/proc/{st.pid}/cmdline", "rb") as f:
                    if f.read().rstrip(b"\0 ") == title:
                        found.append(st.pid)
            except OSError:
                continue
        return found

    def wait_template(self) -> int:
        """The supervisor template's pid, once it serves (its 'ready on' line is logged)."""
        def up() -> int | None:
            try:
                with open(self.layout.supervisor_log) as f:
                    ready = [ln for ln in f if " template[" in ln and " ready on " in ln]
            except FileNotFoundError:
                return None
            for pid in self.template_pids():
                if any(f" template[{pid}] " in ln for ln in ready):
                    return pid
            return None
        return poll_until(up, 30, "the supervisor template to serve")

    def cleanup(self) -> None:
        """Kill the agent, the template, every supervisor and every process of their
        sessions."""
        if self.agent is not None and self.agent.poll() is None:
            self.agent.kill()
            self.agent.wait()
        for pid in self.template_pids():
            _kill(pid)
        sups = self.supervisor_pids()
        sessions = set()
        for pid in sups:
            st = proc_stat(pid)
            if st is not None:
                sessions.add(st.session)
        for pid in sups:
            _kill(pid)
        for st in all_processes():
            if st.session in sessions and st.pid != os.getpid():
                _kill(st.pid)
        left = contain.remove_all(contain.default_base(self.state))

        # A template still importing has no title yet, so template_pids() misses it; it then
        # bound its socket into the state dir while rmtree emptied it, and lived on (its
        # socket was still its own). Anything whose command line names the state dir dies
        # first, and the directory goes once nothing is left to write into it.
        def gone() -> bool:
            for pid in self.strays():
                _kill(pid)
            return not self.strays()
        poll_until(gone, 20, f"every process naming {self.state} to be gone")
        shutil.rmtree(self.dir, ignore_errors=True)
        assert not left, f"the node's step cgroups could not be removed: {left}"

    def strays(self) -> list[int]:
        """Live processes whose command line names this node's state dir (a template before
        its title, the detaching shell, agents started by hand)."""
        found = []
        me = os.getpid()
        for st in all_processes():
            if st.dead or st.pid == me:
                continue
            try:
                with open(f"/proc/{st.pid}/cmdline", "rb") as f:
                    if self.state.encode() in f.read():
                        found.append(st.pid)
            except OSError:
                continue
        return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def one_step_record(node: Node, variable: str, suffix: str) -> list[str]:
    """Start ``node``'s agent with ``variable`` naming a scratch directory (a recording switch
    of shared/faults.py), run one short step under a supervisor forked from the template, and
    return the lines of the ``PID<suffix>`` record it wrote there as it exited."""
    out = tempfile.mkdtemp(dir="/tmp", prefix="ttrec")
    try:
        node.start(env={variable: out})
        node.wait_template()
        job = node.submit("sleep", "0.2")
        assert node.wait_end(job)["state"] == "completed"
        records = poll_until(lambda: glob.glob(os.path.join(out, "*" + suffix)), 30,
                             f"the supervisor to write its {suffix} record as it exits")
        with open(records[0]) as f:
            return f.read().splitlines()
    finally:
        shutil.rmtree(out, ignore_errors=True)
