"""What a task sees at launch: its environment, CPUs, GPUs, rank and output files; and what a
step reports when a task cannot start or one of several fails."""

from __future__ import annotations

import os

from tests.helpers import Node

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
