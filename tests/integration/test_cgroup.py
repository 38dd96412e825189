"""Containment with real cgroups (issue 9): enforced memory and OOM reported, every process of
a step gone with it, suspend and resume, nothing left behind, and the degrade path.

Each test's agent puts its steps' cgroups under a base of its own (a hash of its state
directory), which the node fixture kills and removes whatever happens, so runs of the suite
side by side on one machine never meet.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tests import needs
from tests.helpers import Node, pid_alive, poll_until
from tether.agent.contain import default_base
from tether.shared import cgroup_host, step_cgroup
from tether.shared.cgroup_layout import (
    LEAF,
    Host,
    base_dirs,
    choose,
    parse_mountinfo,
    parse_proc_cgroup,
    step_plan,
)
from tether.shared.procid import ProcId

ROOT = os.geteuid() == 0
#: the checkout (this file is tests/integration/test_cgroup.py)
TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FINAL = ("completed", "failed", "cancelled", "lost")
V1 = cgroup_host.probe("v1") if ROOT else Host("none")
V2 = cgroup_host.probe("v2") if ROOT else Host("none")
needs_memory = pytest.mark.skipif(not (ROOT and cgroup_host.probe().memory),
                                  reason="needs root and a cgroup memory controller")
needs_freezer = pytest.mark.skipif(
    not ROOT or not ("freezer" in V1.own or V2.mode == "v2"),
    reason="needs root and a cgroup freezer (v1 freezer or cgroup2)")
needs_cgroups = pytest.mark.skipif(not ROOT or cgroup_host.probe().mode == "none",
                                   reason="needs root and cgroups")

#: allocates and touches MB megabytes, then says so
HOG = ("import sys; n = int(sys.argv[1]) << 20; b = bytearray(n); "
       "b[::4096] = b'x' * len(range(0, n, 4096)); print('allocated', flush=True)")


def hog(mb: int) -> tuple[str, ...]:
    return (sys.executable, "-c", HOG, str(mb))


def step_dirs(node: Node, job: int, attempt: int = 1) -> list[str]:
    """Where job's cgroup directories are (existing or not), in every mode's hierarchies."""
    base = default_base(node.state)
    return [os.path.join(d, f"{job}.{attempt}")
            for host in (V1, V2) for d in base_dirs(host, base).values()]


def left_cgroups(node: Node) -> list[str]:
    base = default_base(node.state)
    return [os.path.join(d, name) for host in (V1, V2)
            for d in base_dirs(host, base).values() if os.path.isdir(d)
            for name in os.listdir(d) if os.path.isdir(os.path.join(d, name))]


# ---- the probe (pure) ------------------------------------------------------------------------

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
33 31 0:30 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
HYBRID_SELF = "4:memory:/process_api/abc\n6:freezer:/\n8:pids:/\n2:cpu,cpuacct:/\n0::/\n"
PURE_V2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_probe_picks_hybrid_on_a_hybrid_host_without_v2_controllers() -> None:
    mounts = parse_mountinfo(HYBRID)
    own = parse_proc_cgroup(HYBRID_SELF)
    host = choose(mounts, own, {"hugetlb"})
    assert host.mode == "hybrid" and host.memory
    assert host.own == {"memory": "/sys/fs/cgroup/memory/process_api/abc",
                        "unified": "/sys/fs/cgroup/unified"}
    host = choose(mounts, own, {"hugetlb"}, "v1")  # the v1 hierarchies alone
    assert host.mode == "v1" and host.memory
    assert host.own == {"memory": "/sys/fs/cgroup/memory/process_api/abc",
                        "freezer": "/sys/fs/cgroup/freezer", "pids": "/sys/fs/cgroup/pids",
                        "cpuacct": "/sys/fs/cgroup/cpu,cpuacct"}
    assert base_dirs(host, "t")["memory"] == "/sys/fs/cgroup/memory/process_api/abc/t"
    assert base_dirs(host, "/t")["memory"] == "/sys/fs/cgroup/memory/t"
    forced = choose(mounts, own, {"hugetlb"}, "v2")  # tracking and kill, no memory
    assert (forced.mode, forced.memory) == ("v2", False)
    assert forced.own == {"unified": "/sys/fs/cgroup/unified"}


def test_probe_picks_v2_where_it_has_the_memory_controller() -> None:
    host = choose(parse_mountinfo(PURE_V2),
                  parse_proc_cgroup("0::/system.slice/tether-agent.service\n"),
                  {"cpu", "memory", "pids"})
    assert (host.mode, host.memory) == ("v2", True)
    assert host.own == {"unified": "/sys/fs/cgroup/system.slice/tether-agent.service"}
    plan = step_plan(host.mode, base_dirs(host, "jobs"), 7, 2, 50, host.memory)
    assert plan == {"mode": "v2", "memory_mb": 50, "dirs": {
        "unified": "/sys/fs/cgroup/system.slice/tether-agent.service/jobs/7.2"}}


#: In a fresh interpreter: a step's cgroup from a plan with the mount points (as the agent's
#: plan has them), a child forked inside it, this process back home, the mount table unread.
JOIN = """
import os, subprocess, sys
from tether.shared import cgroup_host, step_cgroup
from tether.shared.cgroup_layout import base_dirs, step_plan
host = cgroup_host.probe()
base = sys.argv[1]
plan = step_plan(host.mode, base_dirs(host, base), 1, 1, 0, host.memory, host.roots)
assert plan["roots"] == {k: host.roots[k] for k in plan["dirs"]}, plan
step_cgroup._MOUNTS = None  # the probe read the mount table: forget it
before = open("/proc/self/cgroup").read()
cg = step_cgroup.StepCgroup(plan)
cg.create()
try:
    with cg.joined():
        child = subprocess.Popen(["sleep", "30"])
    assert cg.procs() == {child.pid}, (cg.procs(), child.pid)
    assert open("/proc/self/cgroup").read() == before
    assert step_cgroup._MOUNTS is None, "the mount table was read"
    child.kill()
    child.wait()
finally:
    cg.kill_and_wait()
    cg.remove()
    for d in base_dirs(host, base).values():
        os.rmdir(d)
print("ok")
"""


@needs_cgroups
def test_a_step_finds_its_own_cgroup_from_the_plans_mount_points() -> None:
    base = f"/tether-test-join-{os.getpid()}"
    res = subprocess.run([sys.executable, "-c", JOIN, base], capture_output=True, text=True,
                         timeout=60)
    assert res.stdout == "ok\n", res.stderr


def test_probe_reads_the_agents_leaf_as_its_own_cgroup() -> None:
    """After the agent moved into a leaf to enable controllers (cgroup2's no-internal-process
    rule), a restarted agent finds the same base."""
    host = choose(parse_mountinfo(PURE_V2), parse_proc_cgroup(
        f"0::/tether.slice/tether-agent.service/{LEAF}\n"), {"memory"})
    assert host.own == {"unified": "/sys/fs/cgroup/tether.slice/tether-agent.service"}


def test_pure_v2_limits_and_counts_on_a_fake_cgroupfs(tmp_path: Any) -> None:
    """What this host cannot do for real (its cgroup2 has no memory controller): enabling the
    controllers for the base, memory.max and no swap, the OOM count from memory.events and the
    figures, against plain files laid out as cgroupfs would."""
    own = tmp_path / "tether-agent.service"
    own.mkdir()
    (own / "cgroup.controllers").write_text("cpu io memory pids\n")
    (own / "cgroup.subtree_control").write_text("")
    base = own / "jobs"
    base.mkdir()  # as the agent makes it first; the kernel would add the file
    (base / "cgroup.subtree_control").write_text("")
    cgroup_host.enable_v2_controllers(str(own), str(base))
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert (base / "cgroup.subtree_control").read_text() == "+memory +pids"
    step = base / "7.1"
    step.mkdir()  # the kernel would make these files with the directory
    for name, text in (("memory.max", ""), ("memory.swap.max", ""),  # written in place
                       ("cgroup.procs", ""), ("memory.current", "1048576\n"),
                       ("memory.peak", "52428800\n"), ("cpu.stat", "usage_usec 2500000\n"),
                       ("memory.events", "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n"),
                       ("cgroup.events", "populated 0\nfrozen 0\n")):
        (step / name).write_text(text)
    cg = step_cgroup.StepCgroup({"mode": "v2", "dirs": {"unified": str(step)}, "memory_mb": 50})
    cg.create()
    assert (step / "memory.max").read_text() == str(50 << 20)
    assert (step / "memory.swap.max").read_text() == "0"
    assert cg.oom_kills() == 1
    assert cg.stats() == {"mode": "v2", "memory_current": 1 << 20, "memory_peak": 50 << 20,
                          "memory_limit_mb": 50, "cpu_seconds": 2.5, "pids": 0,
                          "frozen": False}


def test_probe_without_cgroups_is_none() -> None:
    host = choose(parse_mountinfo("22 1 0:21 / /proc rw - proc proc rw\n"), {}, set())
    assert host.mode == "none"
    assert step_plan("none", {}, 1, 1, 50, False) == {"mode": "none"}


# ---- memory ------------------------------------------------------------------------------------

@needs_memory
def test_memory_limit_is_enforced_and_the_oom_reported(node: Node) -> None:
    node.start()
    big = node.submit(*hog(200), opts=("--memory-mb", "50"))
    small = node.submit(*hog(10), opts=("--memory-mb", "50"))
    j = node.wait_end(big)
    assert (j["state"], j["oom"], j["signal"], j["exit_code"]) == ("failed", True, 9, None)
    assert "exceeded its memory limit of 50 MB" in j["reason"]
    assert node.cli("wait", str(big)).returncode == 137
    j = node.wait_end(small)
    assert (j["state"], j["oom"], j["exit_code"]) == ("completed", False, 0)
    assert left_cgroups(node) == []


@needs_memory
def test_oom_while_the_agent_is_down_is_reported(node: Node) -> None:
    node.start()
    go = os.path.join(node.dir, "go")
    job = node.submit("sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done; "
                      f"exec {' '.join(repr(a) for a in hog(200))}",
                      opts=("--memory-mb", "50"))
    node.wait_state(job, ("running",))
    rd = node.layout.run_dir(job, 1)
    node.stop(signal.SIGKILL)
    open(go, "w").close()
    poll_until(lambda: os.path.exists(rd.sentinel), 30, "the exit record")
    node.start()
    j = node.wait_end(job)
    assert (j["state"], j["oom"], j["signal"]) == ("failed", True, 9)
    assert node.cli("wait", str(job)).returncode == 137


# ---- every process of the step dies with it -----------------------------------------------------

def daemon_job(node: Node, then: str) -> tuple[int, str]:
    """A job whose task starts a setsid daemon (its pid in a file), then runs ``then``."""
    pidfile = os.path.join(node.dir, "daemon.pid")
    job = node.submit("sh", "-c", f"setsid sh -c 'echo $$ > {pidfile}.tmp; "
                      f"mv {pidfile}.tmp {pidfile}; exec sleep 300' & {then}")
    return job, pidfile


def read_pid(path: str) -> int:
    def get() -> int | None:
        try:
            with open(path) as f:
                return int(f.read())
        except (FileNotFoundError, ValueError):
            return None
    return poll_until(get, 20, path)


@needs_cgroups
def test_a_setsid_daemon_is_gone_when_the_step_ends(node: Node) -> None:
    node.start()
    go = os.path.join(node.dir, "go")
    job, pidfile = daemon_job(node, f"while [ ! -e {go} ]; do sleep 0.05; done")
    daemon = read_pid(pidfile)
    assert pid_alive(daemon)
    assert any(daemon in step_cgroup.procs_of(d) for d in step_dirs(node, job))
    open(go, "w").close()
    assert node.wait_end(job)["state"] == "completed"
    assert not pid_alive(daemon)
    assert left_cgroups(node) == []


@pytest.mark.parametrize("mode", ["hybrid", "v1", "v2"])
def test_a_setsid_daemon_is_gone_after_its_supervisor_is_sigkilled(make_node: type[Node],
                                                                   mode: str) -> None:
    # v1 kills by freezing, v2 and hybrid by cgroup.kill
    host = cgroup_host.probe(mode) if ROOT else Host("none")
    if not ROOT or host.mode != mode:
        pytest.skip(f"needs root and cgroup {mode}")
    node = make_node(extra=["--cgroup", mode])
    node.start()
    assert node.status()["cgroup"]["mode"] == mode
    job, pidfile = daemon_job(node, "sleep 300")
    daemon = read_pid(pidfile)
    sup = ProcId.from_dict(node.running_manifest(job)["supervisor"])
    # the daemon left the task's session and process group: only the cgroup still holds it
    assert os.getsid(daemon) == daemon
    os.kill(sup.pid, signal.SIGKILL)
    j = node.wait_end(job)
    assert j["state"] == "lost"
    poll_until(lambda: not pid_alive(daemon), 10, "the daemon to be killed")
    assert left_cgroups(node) == []


# ---- suspend and resume -------------------------------------------------------------------------

def counter_value(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


@needs_freezer
def test_suspend_stops_the_job_and_resume_lets_it_finish(node: Node) -> None:
    node.start()
    count = os.path.join(node.dir, "count")
    # counts to 40 in ~2 s of running time, writing each value (atomically: rename)
    job = node.submit("sh", "-c", f"i=0; while [ $i -lt 40 ]; do i=$((i+1)); "
                      f"echo $i > {count}.t; mv {count}.t {count}; sleep 0.05; done")
    poll_until(lambda: counter_value(count) >= 3, 20, "the counter to start")
    node.ok("suspend", str(job))
    j = node.job(job)
    assert j["state"] == "suspended"
    assert node.ok("list", "--state", "s", "--format", "id,state", "--no-header").split() == [
        str(job), "suspended"]
    assert "suspended" in node.ok("inspect", str(job))  # the supervisor says so too
    # the suspension survives an agent restart
    node.stop(signal.SIGKILL)
    node.start()
    assert node.job(job)["state"] == "suspended"
    frozen_at = counter_value(count)
    time.sleep(2)  # the claim itself: nothing moves for 2 s
    assert counter_value(count) == frozen_at, "the counter advanced while suspended"
    assert node.cli("suspend", str(job)).returncode == 1  # already suspended
    node.ok("resume", str(job))
    assert node.job(job)["state"] == "running"
    poll_until(lambda: counter_value(count) > frozen_at, 20, "the counter to go on")
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0)
    assert counter_value(count) == 40
    assert j["suspended_seconds"] >= 2
    assert node.cli("resume", str(job)).returncode == 1  # ended: nothing to resume


@needs_freezer
def test_time_suspended_does_not_count_against_the_time_limit(node: Node) -> None:
    """A 4 s limit; the job is suspended at once and kept so past 4 s of wall time, then runs
    about 1 s more: it completes (Slurm likewise leaves suspended time out of the limit)."""
    node.start()
    go = os.path.join(node.dir, "go")
    job = node.submit("sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done; sleep 1",
                      opts=("--time", "0:04"))
    node.wait_state(job, ("running",))
    t0 = time.monotonic()
    node.ok("suspend", str(job))
    open(go, "w").close()  # read once it is thawed
    poll_until(lambda: time.monotonic() - t0 > 5, 10, "the limit to pass in wall time")
    assert node.job(job)["state"] == "suspended"
    node.ok("resume", str(job))
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0), j


@needs_freezer
def test_a_suspended_job_can_be_cancelled(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", "trap 'exit 3' TERM; while :; do sleep 0.05; done")
    node.wait_state(job, ("running",))
    node.ok("suspend", str(job))
    node.ok("cancel", str(job))
    j = node.wait_end(job)
    assert j["state"] == "cancelled"
    assert j["suspended_seconds"] > 0
    assert left_cgroups(node) == []


def test_suspend_and_resume_refuse_what_they_cannot_do(make_node: type[Node]) -> None:
    node = make_node(extra=["--cgroup", "none"])
    node.start()
    job = node.submit("sleep", "30")
    node.wait_state(job, ("running",))
    res = node.cli("suspend", str(job))
    assert res.returncode == 1 and "cannot suspend job" in res.stderr
    res = node.cli("resume", str(job))
    assert res.returncode == 1 and "not suspended" in res.stderr
    assert node.cli("suspend", "999").returncode == 1
    res = node.cli("resume", "n1")  # a node: needs a cluster
    assert res.returncode == 1 and "needs a cluster" in res.stderr
    node.ok("cancel", str(job))


# ---- nothing left behind ----------------------------------------------------------------------

@needs_cgroups
def test_no_cgroup_is_left_after_100_jobs(make_node: type[Node]) -> None:
    node = make_node(cpus=8)
    node.start()
    # one CLI start for all of them: a shell loop submitting through the same interpreter
    script = ("import sys\nfrom tether.cli.main import main\n"
              "for i in range(100):\n"
              "    assert main(['submit', '--', 'sh', '-c', 'setsid sleep 60 & true']) == 0\n")
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", script], check=True, env=node.env, cwd=node.work,
                   capture_output=True, timeout=120)
    t1 = time.monotonic()

    def states() -> list[str] | None:
        jobs = json.loads(node.ok("list", "--json"))
        return [j["state"] for j in jobs] if all(j["state"] in FINAL for j in jobs) else None
    assert poll_until(states, 120, "100 jobs to end", interval=0.2) == ["completed"] * 100
    print(f"submitted in {t1 - t0:.1f}s, ended {time.monotonic() - t1:.1f}s later")
    assert left_cgroups(node) == []



def bases(node: Node) -> list[str]:
    """The agent's base directories that exist, in every hierarchy."""
    base = default_base(node.state)
    return [d for host in (V1, V2) for d in base_dirs(host, base).values()
            if os.path.isdir(d)]


@needs_cgroups
def test_an_agent_that_stops_leaves_no_empty_base_and_keeps_a_busy_one(node: Node) -> None:
    """An agent stopped with its jobs done removes its (empty) base in every hierarchy: agents
    stopped for good left one directory per hierarchy on the host. Stopped while a job runs,
    it keeps the base, and the job ends in its cgroup under the next agent."""
    node.start()
    job = node.submit("true")
    assert node.wait_end(job)["state"] == "completed"
    assert bases(node)
    assert node.stop() == 0
    assert bases(node) == [], "an idle agent left its cgroup base behind"

    node.start()
    job = node.submit("sh", "-c", "while [ ! -e go ]; do sleep 0.05; done")
    node.wait_state(job, ("running",))
    assert node.stop() == 0
    assert [d for d in step_dirs(node, job) if os.path.isdir(d)], "the running step's cgroup"
    node.start()
    open(os.path.join(node.work, "go"), "w").close()
    assert node.wait_end(job)["state"] == "completed"
    poll_until(lambda: left_cgroups(node) == [], 20, "the step's cgroup to be removed")


@needs_cgroups
def test_a_step_starts_in_its_cgroup_when_the_base_went_away(node: Node) -> None:
    """The base removed under a running agent (the agent before it stopped for good, an
    operator): the next step makes it again instead of failing to start."""
    node.start()
    for d in bases(node):
        os.rmdir(d)
    job = node.submit("cat", "/proc/self/cgroup")
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0), j
    with open(j["output"]) as f:
        assert default_base(node.state) + f"/{job}.1" in f.read()


# ---- the degrade path ------------------------------------------------------------------------

def test_status_says_which_cgroups(make_node: type[Node]) -> None:
    node = make_node(extra=["--cgroup", "none"])
    node.start()
    assert node.status()["cgroup"]["mode"] == "none"
    assert "cgroups    none" in node.ok("status")


@pytest.mark.skipif(not ROOT, reason="the restart tests run with cgroups hidden; as root only")
def test_restart_tests_pass_with_cgroups_hidden() -> None:
    """The restart suite again, every agent with --cgroup none (TETHER_TEST_CGROUP)."""
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/integration/test_restart.py",
                          "tests/integration/test_supervisor_death.py"],
                         cwd=TOP,
                         env=dict(os.environ, TETHER_TEST_CGROUP="none"),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


# ---- the systemd unit ---------------------------------------------------------------------------

def test_the_systemd_unit_verifies(tmp_path: Any) -> None:
    needs.tool("systemd-analyze", "systemd")
    src = os.path.join(TOP, "contrib", "systemd")
    tether = shutil.which("tether", path=os.path.dirname(sys.executable))
    assert tether is not None
    for name in ("tether-agent.service", "tether.slice"):
        with open(os.path.join(src, name)) as f:
            text = f.read()
        # verify checks that ExecStart's program exists: this installation's
        with open(tmp_path / name, "w") as f:
            f.write(text.replace("/usr/local/bin/tether", tether))
    with open(os.path.join(src, "tether-agent.service")) as f:
        unit = f.read()
    for setting in ("KillMode=process", "Delegate=yes", "Slice=tether.slice"):
        assert f"\n{setting}\n" in unit
    res = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "tether-agent.service"),
                          str(tmp_path / "tether.slice")], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and res.stderr == "", res.stderr
