"""Introspection of a running step, straight from its supervisor: info, pids, stats, output
(last lines and a byte-exact follow), events, signal; `tether inspect/attach/signal` and the
`shared.step_client` library, against real agents, supervisors and jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

import tether
from tests.helpers import CLI, Node, default_output, foreign_python, pid_alive, poll_until
from tether.shared import protocol
from tether.shared.client import Client
from tether.shared.errors import RemoteError
from tether.shared.procid import proc_stat
from tether.shared.step_client import StepClient, SupervisorGone, connect, parse_signal

SKIP_ACK = {"TETHER_AGENT_FAULT": "skip-ack"}  # the supervisor stays after the step ends


def step(node: Node, job: int) -> StepClient:
    return connect(job, state_dir=node.state, timeout=5.0)


def path(node: Node, name: str) -> str:
    return os.path.join(node.work, name)


def touch(node: Node, name: str) -> None:
    with open(path(node, name), "w"):
        pass


def wait_file(node: Node, name: str) -> str:
    p = path(node, name)
    poll_until(lambda: os.path.exists(p), 30, f"{name} to appear\n{node.logs()}")
    return p


def read(node: Node, name: str) -> bytes:
    with open(path(node, name), "rb") as f:
        return f.read()


def count_lines(p: str) -> int:
    try:
        with open(p, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def one_line(res: subprocess.CompletedProcess[str]) -> str:
    err = res.stderr.rstrip("\n")
    assert err and "\n" not in err and "Traceback" not in err, repr(res.stderr)
    return err


#: prints "line N" every 20 ms until the file `stop` exists, then "last"
UNTIL_STOP = 'i=0; while [ ! -e stop ]; do echo "line $i"; i=$((i+1)); sleep 0.02; done; echo last'


def numbered(data: bytes) -> list[str]:
    lines = data.decode().splitlines()
    assert lines and lines[-1] == "last", lines[-3:]
    assert lines[:-1] == [f"line {i}" for i in range(len(lines) - 1)], "lines lost or repeated"
    return lines


# ---- info, state, plain inspect ------------------------------------------------------------


def test_info_and_plain_inspect(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", "echo up > up; exec sleep 300", opts=("--name", "infojob"))
    wait_file(node, "up")
    with step(node, job) as s:
        info = s.info()
        st = s.state()
    assert info["command"] == ["sh", "-c", "echo up > up; exec sleep 300"]
    assert (info["uid"], info["user"]) == (os.getuid(), "root")
    assert info["name"] == "infojob" and info["workdir"] == node.work
    assert (info["ntasks"], info["gpus"], info["memory_mb"], info["pmi"]) == (1, [], 0, "none")
    assert len(info["cpus"]) == 1
    assert info["output"] == info["error"] == default_output(node.work, job)
    assert info["protocol"] == protocol.PROTOCOL_VERSION and info["version"] == tether.__version__
    assert info["supervisor_pid"] == st["supervisor_pid"]
    assert st["state"] == "running"

    as_json = json.loads(node.ok("inspect", str(job), "--json"))
    assert as_json["state"] == "running" and as_json["info"]["command"] == info["command"]
    plain = node.ok("inspect", str(job))
    for fragment in ("state          running", "name           infojob",
                     "user           root (uid 0)", f"workdir        {node.work}"):
        assert fragment in plain, plain
    node.ok("cancel", str(job))
    node.wait_end(job)


# ---- pids --------------------------------------------------------------------------------


def test_pids_include_an_adopted_daemon(node: Node) -> None:
    node.start()
    # the subshell forks a setsid'd sleep and exits: the sleep is re-parented to the supervisor
    job = node.submit("sh", "-c", "(setsid sleep 300 & echo $! > daemon.pid); "
                                  "echo up > up; exec sleep 300")
    wait_file(node, "up")
    daemon = int(read(node, "daemon.pid"))
    leader = node.running_manifest(job)["tasks"][0]["pid"]
    sup = node.manifest(job)["supervisor"]["pid"]
    poll_until(lambda: (st := proc_stat(daemon)) is not None and st.ppid == sup, 30,
               "the daemon to be adopted by the supervisor")

    res = json.loads(node.ok("inspect", str(job), "--pids", "--json"))
    assert [(t["rank"], t["pid"], t["alive"]) for t in res["tasks"]] == [(0, leader, True)]
    procs = {p["pid"]: p for p in res["processes"]}
    assert daemon in procs, res
    assert procs[daemon]["adopted"] is True and procs[daemon]["rank"] is None
    assert procs[daemon]["ppid"] == sup and procs[daemon]["comm"] == "sleep"
    assert leader not in procs  # leaders are listed as tasks
    assert all(p["rank"] in (0, None) for p in res["processes"])

    text = node.ok("inspect", str(job), "--pids")
    assert f"0     {leader}" in text and "adopted by the supervisor" in text, text
    with step(node, job) as s:
        assert daemon in {p["pid"] for p in s.pids()["processes"]}
        assert s.stats()["adopted"]["processes"] >= 1

    node.ok("cancel", str(job))
    node.wait_end(job)
    poll_until(lambda: not pid_alive(daemon), 30, "the adopted daemon to be killed")


@pytest.mark.parametrize("fault", ["", "proc-scan"])
def test_pids_and_stats_find_the_same_tree_from_the_children_files_or_all_of_proc(
        node: Node, fault: str) -> None:
    node.start(env={"TETHER_SUPERVISOR_FAULT": fault} if fault else None)
    # the leader (exec'd into sleep), a child shell and its own child, and an adopted daemon
    job = node.submit("sh", "-c", "(setsid sleep 300 & echo $! > daemon.pid); "
                                  "sh -c 'sleep 301 & echo $! > grand.pid; wait' & "
                                  "while [ ! -s grand.pid ]; do sleep 0.01; done; "
                                  "echo up > up; exec sleep 302")
    wait_file(node, "up")
    daemon, grand = int(read(node, "daemon.pid")), int(read(node, "grand.pid"))
    sup = node.manifest(job)["supervisor"]["pid"]
    poll_until(lambda: (st := proc_stat(daemon)) is not None and st.ppid == sup, 30,
               "the daemon to be adopted by the supervisor")
    res = json.loads(node.ok("inspect", str(job), "--pids", "--json"))
    got = sorted((p["comm"], -1 if p["rank"] is None else p["rank"], p["adopted"])
                 for p in res["processes"])
    assert got == [("sh", 0, False), ("sleep", -1, True), ("sleep", 0, False)], res
    assert {p["pid"] for p in res["processes"]} >= {daemon, grand}
    st = json.loads(node.ok("inspect", str(job), "--stats", "--json"))
    assert (st["tasks"][0]["processes"], st["adopted"]["processes"]) == (3, 1), st
    assert st["tasks"][0]["rss_kb"] > 0 and st["adopted"]["rss_kb"] > 0, st
    node.ok("cancel", str(job))
    node.wait_end(job)
    poll_until(lambda: not pid_alive(daemon), 30, "the adopted daemon to be killed")


# ---- stats -------------------------------------------------------------------------------


STATS_JOB = """
import os, time
block = bytearray(64 * 1024 * 1024)
for i in range(0, len(block), 4096):
    block[i] = 1
n = 0
t = time.process_time()
while time.process_time() - t < 0.3:
    n += 1
open("ready", "w").close()
while not os.path.exists("stop"):
    time.sleep(0.02)
"""


def test_stats_are_sane_alive_and_after_the_end(node: Node) -> None:
    node.start(env=SKIP_ACK)
    with open(path(node, "stats.py"), "w") as f:
        f.write(STATS_JOB)
    job = node.submit(sys.executable, "stats.py")
    wait_file(node, "ready")
    with step(node, job) as s:
        live = s.stats()
        t = live["tasks"][0]
        assert t["alive"] and t["processes"] == 1
        assert 0.25 <= t["cpu_user"] + t["cpu_system"] < 30, t
        assert 60_000 <= t["rss_kb"] <= t["peak_rss_kb"] < 4_000_000, t
        assert 0 < t["elapsed"] < 60, t
        assert live["total"]["cpu_user"] >= t["cpu_user"]
        assert live["total"]["rss_kb"] >= t["rss_kb"]
        text = node.ok("inspect", str(job), "--stats")
        lines = [ln for ln in text.splitlines() if ln]
        if live["cgroup"] is None:  # no cgroups here: the table ends with its total
            assert lines[-1].startswith("total"), text
        else:  # the kernel's count for the whole step follows it
            assert lines[-2].startswith("total") and lines[-1].startswith("cgroup ("), text
            cg = live["cgroup"]
            assert cg["pids"] == 1 and cg["cpu_seconds"] > 0, cg
            if cg["memory_current"] is not None:  # counted where a memory controller is
                assert cg["memory_peak"] >= cg["memory_current"] >= 50 << 20, cg

        touch(node, "stop")
        node.wait_end(job)
        ended = s.stats()
        t2 = ended["tasks"][0]
        assert not t2["alive"] and t2["rss_kb"] == 0
        assert t2["cpu_user"] + t2["cpu_system"] >= t["cpu_user"] + t["cpu_system"] - 0.05
        assert t2["peak_rss_kb"] >= 60_000, t2
        assert t["elapsed"] <= t2["elapsed"] < 60
        assert s.stats()["tasks"][0]["elapsed"] == t2["elapsed"]  # no longer counting


# ---- output: the last lines -------------------------------------------------------------------


def test_output_last_lines(node: Node) -> None:
    node.start(env=SKIP_ACK)
    job = node.submit("sh", "-c", "printf 'a\\nb\\nc\\nd\\n'; printf 'e1\\ne2\\ne3' >&2",
                      opts=("--output", "o.txt", "--error", "e.txt"))
    node.wait_end(job)
    res = node.cli("inspect", str(job), "--output", "--lines", "2")
    assert res.returncode == 0, res.stderr
    assert (res.stdout, res.stderr) == ("c\nd\n", "e2\ne3")
    res = node.cli("inspect", str(job), "--output")
    assert (res.stdout, res.stderr) == ("a\nb\nc\nd\n", "e1\ne2\ne3")
    res = node.cli("inspect", str(job), "--output", "--lines", "0")
    assert (res.returncode, res.stdout, res.stderr) == (0, "", "")
    js = json.loads(node.ok("inspect", str(job), "--output", "--lines", "1", "--json"))
    assert js["stdout"]["data"] == "d\n" and js["stderr"]["data"] == "e3"
    with step(node, job) as s:
        assert s.output(lines=2) == {"stdout": b"c\nd\n", "stderr": b"e2\ne3"}
        assert s.output(lines=100, stream="stderr") == {"stderr": b"e1\ne2\ne3"}

    for bad in (["--lines", "-1"], ["--lines", "x"]):
        res = node.cli("inspect", str(job), "--output", *bad)
        assert res.returncode == 2 and "--lines" in one_line(res)
    res = node.cli("inspect", str(job), "--lines", "3")
    assert res.returncode == 2 and "--output" in one_line(res)


# ---- attach --------------------------------------------------------------------------------


def test_attach_mid_job_sees_every_line_once_and_exits_0(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", 'for i in $(seq 0 59); do echo "line $i"; sleep 0.03; done')
    out = default_output(node.work, job)
    poll_until(lambda: count_lines(out) >= 5, 30, "the job to print a few lines")
    res = node.cli("attach", str(job), timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert res.stdout == "".join(f"line {i}\n" for i in range(60))
    assert node.job(job)["state"] == "completed"
    # once the supervisor is gone, attach is refused with one line, like inspect
    poll_until(lambda: not node.supervisor_pids(), 30, "the supervisor to exit")
    res = node.cli("attach", str(job))
    assert res.returncode == 1 and "no supervisor" in one_line(res)


def test_attach_separates_stdout_and_stderr(node: Node) -> None:
    node.start(env=SKIP_ACK)
    job = node.submit("sh", "-c", "echo out1; echo err1 >&2; echo out2; echo err2 >&2",
                      opts=("--error", "err.txt"))
    node.wait_end(job)
    res = node.cli("attach", str(job))  # the step has ended: everything, then exit 0
    assert (res.returncode, res.stdout, res.stderr) == (0, "out1\nout2\n", "err1\nerr2\n")


def test_attach_and_inspect_survive_the_agent_dying_and_restarting(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", UNTIL_STOP)
    node.wait_state(job, ("running",))
    attached = path(node, "attached.txt")
    with open(attached, "wb") as sink:
        proc = subprocess.Popen([*CLI, "attach", str(job)], stdout=sink,
                                stderr=subprocess.PIPE, env=node.env, cwd=node.work)
    try:
        poll_until(lambda: count_lines(attached) >= 5, 30, "attach to print")
        node.stop(signal.SIGKILL)
        seen = count_lines(attached)
        poll_until(lambda: count_lines(attached) >= seen + 20, 30,
                   "attach to keep following while the agent is dead")
        st = json.loads(node.ok("inspect", str(job), "--json"))
        assert st["state"] == "running" and st["info"]["name"] == "sh"
        assert "RANK" in node.ok("inspect", str(job), "--stats")
        assert str(st["pids"][0]) in node.ok("inspect", str(job), "--pids")
        assert node.ok("inspect", str(job), "--output", "--lines", "1").strip()
        node.start()
        assert str(st["pids"][0]) in node.ok("inspect", str(job), "--pids")
        seen = count_lines(attached)
        poll_until(lambda: count_lines(attached) >= seen + 20, 30,
                   "attach to keep following after the agent restarted")
        touch(node, "stop")
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert err == b""
    data = read(node, "attached.txt")
    assert data == read(node, os.path.basename(default_output(node.work, job)))
    numbered(data)
    assert node.wait_end(job)["state"] == "completed"


def test_attach_ctrl_c_detaches_and_the_job_keeps_running(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", UNTIL_STOP)
    node.wait_state(job, ("running",))
    attached = path(node, "attached.txt")
    with open(attached, "wb") as sink:
        proc = subprocess.Popen([*CLI, "attach", str(job)], stdout=sink,
                                stderr=subprocess.PIPE, env=node.env, cwd=node.work)
    poll_until(lambda: count_lines(attached) >= 3, 30, "attach to print")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and b"Traceback" not in err, err
    assert node.job(job)["state"] == "running"
    out = default_output(node.work, job)
    seen = count_lines(out)
    poll_until(lambda: count_lines(out) > seen + 5, 30, "the job to go on printing")
    touch(node, "stop")
    assert node.wait_end(job)["state"] == "completed"


# ---- follow_output, events and wake-ups (the library) ---------------------------------------


def test_follow_and_events_through_the_library(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", 'echo "rank $TETHER_TASK_ID"; echo "e$TETHER_TASK_ID" >&2; '
                      "while [ ! -e stop ]; do sleep 0.02; done",
                      opts=("--ntasks", "2", "--error", "err-%j.txt"))
    node.wait_state(job, ("running",))
    got: dict[str, bytes] = {"stdout": b"", "stderr": b""}
    kinds: list[tuple[str, Any]] = []
    with step(node, job) as s:
        events = s.events(hold=5)
        first = [next(events), next(events)]
        assert sorted((e["kind"], e["rank"]) for e in first) == [
            ("task_started", 0), ("task_started", 1)]
        assert [e["seq"] for e in first] == [1, 2]
        follow = s.follow_output(hold=5)
        while got["stdout"].count(b"\n") < 2 or got["stderr"].count(b"\n") < 2:
            name, data = next(follow)
            got[name] += data
        touch(node, "stop")
        for name, data in follow:
            got[name] += data
        assert s.offsets == {"stdout": len(got["stdout"]), "stderr": len(got["stderr"])}
        assert not s.fell_back
        kinds = [(e["kind"], e.get("rank")) for e in events]
    assert sorted(got["stdout"].splitlines()) == [b"rank 0", b"rank 1"]
    assert sorted(got["stderr"].splitlines()) == [b"e0", b"e1"]
    assert sorted(kinds[:2]) == [("task_exited", 0), ("task_exited", 1)]
    assert kinds[2:] == [("step_ended", None)]


def wakeups(pid: int) -> int:
    """Voluntary context switches of the process's main thread (its event loop)."""
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches")


def blocked_in_poll(pid: int) -> bool:
    """Is the process's main thread asleep in poll(2) (x86-64: 7; ppoll: 271)?

    A reply can reach a client before the loop iteration that sent it has ended; counting
    wake-ups from then would count that iteration's own going back to sleep."""
    with open(f"/proc/{pid}/task/{pid}/syscall") as f:
        return f.read().split()[0] in ("7", "271")


def test_parked_followers_are_woken_promptly(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", "while [ ! -e go ]; do sleep 0.01; done; echo hello; "
                      "while [ ! -e stop ]; do sleep 0.01; done")
    node.wait_state(job, ("running",))
    with step(node, job) as s:
        sock = s.path
        seq = s.call("events", {"after": 0})["last"]
        sup = s.hello["pid"]
    with Client(sock, timeout=40) as follower, Client(sock, timeout=40) as waiter, \
            Client(sock, timeout=5) as other:
        result: dict[str, Any] = {}

        def follow() -> None:
            result["out"] = follower.call("output", {"offset": {"stdout": 0}, "hold": 30})
            result["out_at"] = time.monotonic()

        def wait_event() -> None:
            result["ev"] = waiter.call("events", {"after": seq, "hold": 30})
            result["ev_at"] = time.monotonic()

        threads = [threading.Thread(target=follow), threading.Thread(target=wait_event)]
        for t in threads:
            t.start()
        other.call("state")  # a round trip: the two long polls are (in practice) parked
        t0 = time.monotonic()
        touch(node, "go")
        threads[0].join(30)
        assert result["out"]["stdout"]["data"] == b"hello\n"
        assert result["out_at"] - t0 < 2.0, "the output follower was not woken promptly"
        # No output follower is parked now (an events waiter is): the supervisor's loop must
        # not wake up periodically. This sleep measures idleness; it synchronises nothing.
        poll_until(lambda: blocked_in_poll(sup), 10, "the supervisor's loop to block in poll")
        before = wakeups(sup)
        time.sleep(1.0)
        assert wakeups(sup) == before, "the supervisor woke up with no output follower parked"
        t1 = time.monotonic()
        touch(node, "stop")
        threads[1].join(30)
        assert result["ev"]["events"][0]["kind"] == "task_exited"
        assert result["ev_at"] - t1 < 2.0, "the events waiter was not woken promptly"
    node.wait_end(job)


def test_followers_drain_after_the_agent_acknowledged(node: Node) -> None:
    """The step ends with a lot of output unread; the agent acknowledges at once; the
    supervisor stays until the follower has read to the end (it would otherwise exit)."""
    node.start()
    job = node.submit(sys.executable, "-c",
                      "import os, time\n"
                      "while not os.path.exists('go'): time.sleep(0.01)\n"
                      "for i in range(40000): print(f'line {i:06d} ' + 'x' * 40)\n")
    node.wait_state(job, ("running",))
    got = b""
    with step(node, job) as s:
        follow = s.follow_output(hold=5, fallback=False)
        touch(node, "go")
        got += next(follow)[1]
        poll_until(lambda: node.job(job)["state"] == "completed", 30,
                   "the agent to collect (and acknowledge) the result")
        for _, data in follow:
            got += data
    out = os.path.basename(default_output(node.work, job))
    assert len(got) > 1_000_000 and got == read(node, out)
    poll_until(lambda: not node.supervisor_pids(), 30, "the supervisor to exit once drained")


def test_supervisor_gone(node: Node) -> None:
    with pytest.raises(SupervisorGone, match="no supervisor"):
        connect(4242, state_dir=node.state)
    node.start()
    job = node.submit("sh", "-c", UNTIL_STOP)
    node.wait_state(job, ("running",))
    sup = node.manifest(job)["supervisor"]["pid"]
    s = step(node, job)
    s2 = step(node, job)
    try:
        events = s.events(hold=30)
        next(events)  # task_started
        follow = s2.follow_output(hold=30)
        name, seen = next(follow)
        assert name == "stdout"
        killer = threading.Timer(0.3, os.kill, (sup, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(SupervisorGone, match="went away"):
            next(events)  # parked with hold=30: the death is noticed through /proc
        assert time.monotonic() - t0 < 5
        # the follower finishes from the file where it stopped, without repeating a byte
        seen += b"".join(data for _, data in follow)
        assert s2.fell_back
        assert s2.offsets["stdout"] == len(seen)
        assert read(node, os.path.basename(default_output(node.work, job))).startswith(seen)
        assert seen.endswith(b"\n")
    finally:
        s.close()
        s2.close()
    assert node.wait_end(job)["state"] == "lost"


# ---- signal --------------------------------------------------------------------------------


SIGNAL_JOB = """
import os, signal
rank = os.environ["TETHER_TASK_ID"]
def note(sig, frame):
    with open(f"got.{rank}", "a") as f:
        f.write(f"{sig}\\n")
signal.signal(signal.SIGUSR1, note)
signal.signal(signal.SIGUSR2, note)
open(f"ready.{rank}", "w").close()
while True:
    signal.pause()
"""


def got(node: Node, rank: int) -> list[int]:
    try:
        return [int(x) for x in read(node, f"got.{rank}").split()]
    except FileNotFoundError:
        return []


def test_signal_by_name_number_and_rank(node: Node) -> None:
    node.start(env=SKIP_ACK)
    with open(path(node, "sig.py"), "w") as f:
        f.write(SIGNAL_JOB)
    job = node.submit(sys.executable, "sig.py", opts=("--ntasks", "2"))
    wait_file(node, "ready.0")
    wait_file(node, "ready.1")
    node.ok("signal", str(job), "USR1")
    poll_until(lambda: got(node, 0) == [10] and got(node, 1) == [10], 30, "USR1 on both ranks")
    node.ok("signal", str(job), "12", "--rank", "1")
    poll_until(lambda: got(node, 1) == [10, 12], 30, "USR2 on rank 1")
    node.ok("signal", str(job), "sigusr2", "--rank", "0")
    poll_until(lambda: got(node, 0) == [10, 12], 30, "USR2 on rank 0")
    with step(node, job) as s:
        assert s.signal("SIGUSR1", rank=1) == {"signal": 10, "name": "SIGUSR1", "ranks": [1]}
    poll_until(lambda: got(node, 1) == [10, 12, 10], 30, "USR1 on rank 1")
    assert got(node, 0) == [10, 12]

    for argv, code, fragment in [
        (["BOGUS"], 2, "unknown signal"),
        (["99"], 2, "not a valid signal"),
        (["TERM", "--rank", "2"], 1, "no rank 2"),
        (["TERM", "--rank", "-1"], 2, "negative"),
        (["TERM"], 1, "no supervisor"),  # job 4242, below
    ]:
        target = "4242" if fragment == "no supervisor" else str(job)
        res = node.cli("signal", target, *argv)
        assert res.returncode == code and fragment in one_line(res), (argv, res.stderr)

    node.ok("signal", str(job), "15", "--rank", "0")
    poll_until(lambda: json.loads(node.ok("inspect", str(job), "--pids", "--json"))
               ["tasks"][0]["signal"] == 15, 30, "rank 0 to die of SIGTERM")
    node.ok("signal", str(job), "KILL")
    end = node.wait_end(job)
    assert (end["state"], end["signal"]) == ("failed", 15), end
    res = node.cli("signal", str(job), "USR1")  # the step has ended; its supervisor stays
    assert res.returncode == 1 and "not running" in one_line(res)
    ev = json.loads(node.ok("inspect", str(job), "--events", "--json"))
    assert ev["ended"] is True
    assert [e["seq"] for e in ev["events"]] == [1, 2, 3, 4, 5]
    assert [e["kind"] for e in ev["events"]] == ["task_started"] * 2 + ["task_exited"] * 2 + [
        "step_ended"]
    assert ev["events"][-1]["state"] == "failed"
    assert "step_ended" in node.ok("inspect", str(job), "--events")


# ---- another user -------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_another_user_sees_the_state_and_nothing_else(node: Node) -> None:
    os.chmod(node.dir, 0o755)
    node.start()
    job = node.submit("sh", "-c", "echo secret; echo up > up; exec sleep 300")
    wait_file(node, "up")

    python, extra = foreign_python()

    def as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*python, "-m", "tether.cli.main", *args], capture_output=True,
                              text=True, env=dict(node.env, **extra), cwd="/", user="nobody",
                              timeout=60)
    res = as_nobody("inspect", str(job))
    assert res.returncode == 0, res.stderr
    assert "state          running" in res.stdout and "command" not in res.stdout
    assert "info" not in json.loads(as_nobody("inspect", str(job), "--json").stdout)
    for argv in (["inspect", str(job), "--pids"], ["inspect", str(job), "--stats"],
                 ["inspect", str(job), "--output"], ["inspect", str(job), "--events"],
                 ["attach", str(job)], ["signal", str(job), "TERM"]):
        res = as_nobody(*argv)
        assert res.returncode == 1 and "permission denied" in one_line(res), (argv, res)
        assert "secret" not in res.stdout + res.stderr
    assert node.job(job)["state"] == "running"
    node.ok("cancel", str(job))
    node.wait_end(job)


def test_parse_signal() -> None:
    assert parse_signal("TERM") == parse_signal("SIGTERM") == parse_signal("sigterm") == 15
    assert parse_signal("15") == parse_signal(15) == 15
    assert parse_signal("RTMIN+2") == signal.SIGRTMIN + 2
    for bad in ("", "NOPE", "0", "65", "-1", "SIG"):
        with pytest.raises(ValueError):
            parse_signal(bad)


# ---- malformed requests ----------------------------------------------------------------------


BAD_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    ("output", {"lines": -1}, "at least 0"),
    ("output", {"lines": "3"}, "integer"),
    ("output", {"lines": True}, "integer"),
    ("output", {"lines": 10**7}, "at most"),
    ("output", {"stream": "stdin"}, "stdout, stderr or both"),
    ("output", {"offset": {"stdout": -1}}, "at least 0"),
    ("output", {"offset": {"stdout": 10**12}}, "past the end"),
    ("output", {"offset": {"stdout": 2**63}}, "at most"),
    ("output", {"offset": {"nope": 0}}, "not one of the streams"),
    ("output", {"offset": 5}, "must be a map"),
    ("output", {"offset": {"stdout": 0}, "lines": 2}, "exclude each other"),
    ("output", {"hold": 1}, "needs 'offset'"),
    ("output", {"offset": {"stdout": 0}, "hold": -1}, "between"),
    ("output", {"offset": {"stdout": 0}, "hold": 10**9}, "between"),
    ("output", {"bogus": 1}, "unknown arguments"),
    ("events", {"after": -1}, "at least 0"),
    ("events", {"after": 10**6}, "past the last event"),
    ("events", {"hold": "x"}, "number"),
    ("signal", {}, "missing argument"),
    ("signal", {"signal": 0}, "not a valid signal"),
    ("signal", {"signal": 99}, "not a valid signal"),
    ("signal", {"signal": -9}, "not a valid signal"),
    ("signal", {"signal": "TERM"}, "integer"),
    ("signal", {"signal": 10, "rank": -1}, "at least 0"),
    ("signal", {"signal": 10, "rank": 1}, "no rank 1"),
    ("signal", {"signal": 10, "rank": "0"}, "integer"),
    ("info", {"x": 1}, "unknown arguments"),
    ("pids", {"x": 1}, "unknown arguments"),
    ("stats", {"x": 1}, "unknown arguments"),
]


def test_malformed_arguments_get_errors_and_the_supervisor_keeps_serving(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", "echo up > up; exec sleep 300")
    wait_file(node, "up")
    with step(node, job) as s:
        for kind, args, fragment in BAD_REQUESTS:
            with pytest.raises(RemoteError) as info:
                s.call(kind, args)
            assert info.value.code == "bad_request", (kind, args, info.value.message)
            assert fragment in info.value.message, (kind, args, info.value.message)
        assert s.state()["state"] == "running"
        assert s.output(lines=1) == {"stdout": b""}
        assert s.call("events", {"after": 1})["events"] == []
    assert node.job(job)["state"] == "running"
    node.ok("cancel", str(job))
    node.wait_end(job)


# ---- the pure helpers ------------------------------------------------------------------------


def _stat_line(pid: int, comm: str, state: str, ppid: int, pgrp: int, session: int,
               utime: int = 0, stime: int = 0, cutime: int = 0, cstime: int = 0,
               start: int = 100, rss_pages: int = 0) -> bytes:
    # fields 3.. of /proc/PID/stat; 14-17 times, 22 start time, 24 rss (pages)
    rest = [state, ppid, pgrp, session, 0, -1, 4194560, 0, 0, 0, 0, utime, stime, cutime,
            cstime, 20, 0, 1, 0, start, 1000, rss_pages]
    return f"{pid} ({comm}) {' '.join(str(x) for x in rest)} 0 0 0\n".encode()


def test_parse_stat_and_status() -> None:
    from tether.supervisor import introspect as ins
    raw = _stat_line(42, "a b) (c", "S", 7, 42, 5, utime=250, stime=50, cutime=100,
                     cstime=0, start=1234, rss_pages=10)
    st = ins.parse_stat(42, raw)
    assert st is not None
    assert (st.comm, st.state, st.ppid, st.pgrp, st.session) == ("a b) (c", "S", 7, 42, 5)
    assert st.start_ticks == 1234 and st.rss_kb == 10 * ins.PAGE_KB
    assert st.cpu_user == 350 / ins.CLK_TCK and st.cpu_system == 50 / ins.CLK_TCK
    assert ins.parse_stat(1, b"garbage") is None
    assert ins.parse_stat(1, b"1 (x) S 1") is None
    status = "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nThreads:\t1\n"
    assert ins.parse_status_memory(status) == (1024, 2048)
    assert ins.parse_status_memory("Name:\tkthreadd\n") == (None, None)


def test_step_processes_split_by_task_and_adopted() -> None:
    from tether.supervisor import introspect as ins

    def p(pid: int, ppid: int, session: int = 10, state: str = "S") -> Any:
        st = ins.parse_stat(pid, _stat_line(pid, "x", state, ppid, pid, session))
        assert st is not None
        return st
    procs = [
        p(1, 0, 1), p(5, 1, 5),      # init, the agent elsewhere
        p(10, 1),                    # the detaching shell, session leader (an ancestor here)
        p(20, 10),                   # the supervisor
        p(30, 20), p(31, 30), p(32, 31),  # task 0 (leader 30) and its descendants
        p(40, 20), p(41, 40, 41),    # task 1 (leader 40); a child in its own session
        p(50, 20, 50), p(51, 50, 50),  # adopted daemon and its child
        p(60, 20, state="Z"),        # an unreaped zombie child: left out
        p(70, 1),                    # in the session but not below the supervisor
        p(80, 1, 80),                # unrelated
    ]
    out = ins.step_processes(procs, 20, 10, {30: 0, 40: 1})
    assert {r: [x.pid for x in g] for r, g in out.by_rank.items()} == {0: [30, 31, 32],
                                                                        1: [40, 41]}
    assert [x.pid for x in out.adopted] == [50, 51, 70]
    assert out.owner[32] == 0 and out.owner[51] is None
    assert 10 not in out.owner and 20 not in out.owner and 60 not in out.owner


def test_tail_start() -> None:
    from tether.supervisor import introspect as ins

    def tail(data: bytes, n: int, cap: int = ins.TAIL_MAX, chunk: int = 3) -> tuple[bytes, bool]:
        def read(off: int, length: int) -> bytes:
            return data[off:off + length]
        start, truncated = ins.tail_start(read, len(data), n, cap, chunk)
        return data[start:], truncated
    assert tail(b"a\nb\nc\n", 2) == (b"b\nc\n", False)
    assert tail(b"a\nb\nc", 2) == (b"b\nc", False)
    assert tail(b"a\nb\nc\n", 5) == (b"a\nb\nc\n", False)
    assert tail(b"a\nb\nc\n", 0) == (b"", False)
    assert tail(b"", 3) == (b"", False)
    assert tail(b"\n\n\n", 2) == (b"\n\n", False)
    assert tail(b"long line here\nx\n", 2, cap=6) == (b"ere\nx\n", True)
    assert ins.read_span(lambda off, n: b"abcdef"[off:off + min(n, 2)], 1, 6, 4) == b"bcde"
    assert ins.elapsed(0, None, 50.0) == 0.0
    assert ins.elapsed(ins.CLK_TCK * 10, None, 12.5) == 2.5
    assert ins.elapsed(ins.CLK_TCK * 10, 11.0, 99.0) == 1.0
