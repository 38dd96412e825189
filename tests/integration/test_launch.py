"""What a task sees at launch: its environment, CPUs, GPUs, rank and output files; and what a
step reports when a task cannot start or one of several fails."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys

import pytest

from tests.helpers import Node, poll_until
from tether.shared import records
from tether.shared.procid import proc_stat

PROBE = (
    'echo "rank=$TETHER_TASK_ID ntasks=$TETHER_NTASKS job=$TETHER_JOB_ID '
    'cuda=$CUDA_VISIBLE_DEVICES rocr=$ROCR_VISIBLE_DEVICES hip=$HIP_VISIBLE_DEVICES '
    'mine=$MY_VAR cpus=$(grep Cpus_allowed_list /proc/self/status | cut -f2)"'
)


def _cpulist(cpus: set[int]) -> str:
    ids = sorted(cpus)
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None], strict=False):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def test_each_task_gets_its_rank_cpus_gpus_and_environment(make_node: type[Node]) -> None:
    node = make_node(extra=["--gpus", "2"])
    node.start()
    job = node.submit("sh", "-c", PROBE, opts=("--ntasks", "2", "--cpus", "1", "--gpus", "2",
                                               "--env", "MY_VAR=hello"))
    j = node.wait_end(job)
    assert (j["state"], j["cpus"], j["gpus"], j["ntasks"]) == ("completed", [0, 1], [0, 1], 2)
    with open(j["output"]) as f:
        lines = sorted(f.read().splitlines())
    allowed = sorted(os.sched_getaffinity(0))
    expect = []
    for rank in (0, 1):
        phys = rank if rank in allowed else allowed[rank % len(allowed)]
        expect.append(f"rank={rank} ntasks=2 job={job} cuda=0,1 rocr=0,1 hip=0,1 mine=hello "
                      f"cpus={_cpulist({phys})}")
    assert lines == expect



def test_the_supervisor_leaves_a_task_s_cpus_before_it_forks_the_next(node: Node) -> None:
    """Each task is forked with the supervisor on the task's CPUs, which the child inherits
    before it execs; the supervisor is back on its own as soon as the fork returns. Still
    pinned, it would wait for the new task's time slice before it could fork the next rank."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one CPU: no two tasks to pin apart")
    node.start(env={"TETHER_SUPERVISOR_FAULT": "hold-after-task"})
    job = node.submit("sh", "-c", "grep Cpus_allowed_list /proc/self/status | cut -f2",
                      opts=("--ntasks", "2"))
    rd = node.layout.run_dir(job, 1)
    poll_until(lambda: os.path.exists(os.path.join(rd.path, "task.held")), 30,
               "the first task to be started")
    sup = records.read_manifest(rd.manifest)["supervisor"]["pid"]
    try:
        assert os.sched_getaffinity(sup) == set(allowed)
    finally:
        open(os.path.join(rd.path, "task.go"), "w").close()
    j = node.wait_end(job)
    assert (j["state"], j["cpus"]) == ("completed", [0, 1])
    with open(j["output"]) as f:
        assert sorted(f.read().split()) == [str(c) for c in allowed[:2]]

def test_output_and_error_go_to_their_files(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", "echo out; echo err >&2",
                      opts=("--output", "o-%j.txt", "--error", "e-%j.txt"))
    j = node.wait_end(job)
    assert j["output"] == os.path.join(node.work, f"o-{job}.txt")
    with open(os.path.join(node.work, f"o-{job}.txt")) as f:
        assert f.read() == "out\n"
    with open(os.path.join(node.work, f"e-{job}.txt")) as f:
        assert f.read() == "err\n"


def test_a_command_that_cannot_be_executed_fails_with_127(node: Node) -> None:
    node.start()
    job = node.submit("/nonexistent/program", "arg")
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"], j["signal"]) == ("failed", 127, None)
    assert "cannot execute '/nonexistent/program'" in j["reason"]
    assert node.cli("wait", str(job)).returncode == 127
    assert node.status()["cpus"]["allocated"] == 0


def test_the_first_failing_task_is_the_step_result(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", 'if [ "$TETHER_TASK_ID" = 1 ]; then exit 3; fi; sleep 0.5',
                      opts=("--ntasks", "3"))
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("failed", 3)
    assert "task 1" in j["reason"]


def test_a_task_killed_by_a_signal(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", "kill -SEGV $$")
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"], j["signal"]) == ("failed", None, 11)
    assert "SIGSEGV" in j["reason"]
    assert node.cli("wait", str(job)).returncode == 128 + 11


def test_submit_wait_json_and_memory_accounting(node: Node) -> None:
    node.start()
    res = node.cli("submit", "--memory-mb", "100", "--wait", "--", "sh", "-c", "exit 2")
    assert res.returncode == 2
    job = int(res.stdout.strip())
    j = node.job(job)
    assert (j["memory_mb"], j["state"]) == (100, "failed")
    assert node.status()["memory_mb"]["allocated"] == 0


#: inotify(7): a file renamed into the watched directory, a file created in it (watched too:
#: the kernel merges identical events in a row, and the temporary file of each write keeps
#: two renames apart)
IN_MOVED_TO, IN_CREATE = 0x80, 0x100


def _manifests_written(fd: int) -> list[str]:
    """The names renamed into the watched run directory so far (inotify events)."""
    names = []
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return names
        pos = 0
        while pos < len(data):
            _, mask, _, size = struct.unpack_from("iIII", data, pos)
            name = data[pos + 16:pos + 16 + size].rstrip(b"\0").decode()
            if mask & IN_MOVED_TO:
                names.append(name)
            pos += 16 + size


def test_a_claimed_step_writes_no_ready_manifest(node: Node) -> None:
    """``ready`` on disk means what no manifest means (never ran): a step claimed at once
    writes only ``launching`` and ``running`` (each renamed into place); one left unclaimed
    writes ``ready`` (tests/integration/test_restart.py)."""
    libc = ctypes.CDLL(None, use_errno=True)
    node.start(env={"TETHER_AGENT_FAULT": "hold-spawn-prep"})
    job = node.submit("true")
    poll_until(lambda: os.path.exists(os.path.join(node.state, "prep.held")), 20,
               "the run directory to be made, its supervisor not yet started")
    rd = node.layout.run_dir(job, 1)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    try:
        assert libc.inotify_add_watch(fd, rd.path.encode(), IN_MOVED_TO | IN_CREATE) >= 0
        with open(os.path.join(node.state, "prep.go"), "w"):
            pass
        assert node.wait_end(job)["state"] == "completed"
        written = _manifests_written(fd)
    finally:
        os.close(fd)
    assert (written.count("manifest.json"), written.count("exit.json")) == (2, 1), written


def test_each_task_s_recorded_identity_is_the_kernel_s(make_node: type[Node]) -> None:
    """The start ticks a supervisor records for its tasks (from the clock around each fork,
    ``procid.boot_ticks``, or /proc when a tick passed) are the ones /proc shows: the identity
    every later check of "is this still that task" compares against."""
    node = make_node(cpus=16)
    node.start()
    job = node.submit("sleep", "60", opts=("--ntasks", "12"))
    try:
        tasks = node.running_manifest(job)["tasks"]
        assert len(tasks) == 12
        for t in tasks:
            st = proc_stat(t["pid"])
            assert st is not None and (t["pid"], t["start_ticks"]) == (st.pid, st.start_ticks), t
    finally:
        node.ok("cancel", str(job))
    assert node.wait_end(job)["state"] == "cancelled"


#: forks from a small interpreter (as a supervisor's are): the test process itself may be large
#: enough (pytest's hundreds of MiB) that its forks take ms, and straddle ticks half the time
TICKS_PROBE = """
import os, sys
from tether.shared.procid import boot_ticks, proc_stat
same = 0
for _ in range(200):
    before = boot_ticks()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    after = boot_ticks()
    try:
        st = proc_stat(pid)
        assert st is not None
        assert before <= st.start_ticks <= after, (before, st.start_ticks, after)
        same += before == after
        if before == after:
            assert st.start_ticks == before, (before, st.start_ticks)
    finally:
        os.waitpid(pid, 0)
print(same)
"""


def test_boot_ticks_around_a_fork_are_the_child_s_start_ticks() -> None:
    """When the clock reads the same tick before and after a fork, the child's start ticks
    in /proc are that tick (when a tick passed, they lie between the two)."""
    res = subprocess.run([sys.executable, "-c", TICKS_PROBE], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert int(res.stdout) > 100  # a tick is 10 ms; a small process's fork takes well under one
