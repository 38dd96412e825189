"""Real MPI under tether's PMI server: MPICH (PMI-1) and Slurm's libpmi2 (PMI-2), clients no one
here wrote. The programs are in tests/mpi/ and are built once per session."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from tests.helpers import Node, poll_until

HERE = os.path.join(os.path.dirname(__file__), "mpi")


@pytest.fixture(scope="session")
def programs() -> Iterator[dict[str, str]]:
    for tool in ("mpicc", "gcc"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: run scripts/setup.sh --tests (it installs mpich, "
                        "libmpich-dev and libpmi2-0-dev)")
    out = tempfile.mkdtemp(dir="/tmp", prefix="ttmpi")
    built = {"hello": os.path.join(out, "hello_mpi"), "pmi2": os.path.join(out, "pmi2_client")}
    subprocess.run(["mpicc", "-O1", "-o", built["hello"], os.path.join(HERE, "hello_mpi.c")],
                   check=True)
    subprocess.run(["gcc", "-O1", "-o", built["pmi2"], os.path.join(HERE, "pmi2_client.c"),
                    "-lpmi2"], check=True)
    try:
        yield built
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return sorted(f.read().splitlines())


def _pmi(node: Node, job: int) -> dict[str, object] | None:
    res = node.cli("inspect", str(job), "--pmi", "--json")
    if res.returncode != 0:
        return None
    snap: dict[str, object] = json.loads(res.stdout)
    return snap


@pytest.mark.parametrize("ranks", [2, 4])
def test_mpi_program_completes(node: Node, programs: dict[str, str], ranks: int) -> None:
    node.start()
    job = node.submit(programs["hello"], opts=("--ntasks", str(ranks), "--pmi", "pmi1"))
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0), j["reason"]
    assert _lines(j["output"]) == sorted(
        f"rank {r} of {ranks} OK (sum {ranks}, from {(r - 1) % ranks})" for r in range(ranks))


def test_agent_killed_while_ranks_wait_in_a_barrier(node: Node, programs: dict[str, str]) -> None:
    node.start()
    go = os.path.join(node.work, "go")
    job = node.submit(programs["hello"], opts=("--ntasks", "4", "--pmi", "pmi1", "--env",
                                               f"HELLO_WAIT_FILE={go}"))
    snap = poll_until(lambda: (s := _pmi(node, job)) and s["waiting"] == [1, 2, 3] and s,
                      30, "ranks 1-3 to wait in the PMI barrier while rank 0 holds back")
    assert snap["epoch"] == 0
    node.stop(signal.SIGKILL)
    node.start()
    assert node.job(job)["state"] == "running"
    with open(go, "w"):
        pass
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0), j["reason"]
    assert len([line for line in _lines(j["output"]) if " OK " in line]) == 4


def test_a_rank_dying_before_init_fails_the_step(node: Node, programs: dict[str, str]) -> None:
    node.start()
    job = node.submit(programs["hello"], opts=("--ntasks", "3", "--pmi", "pmi1", "--env",
                                               "HELLO_DIE_RANK=1"))
    j = node.wait_end(job, timeout=20)
    assert (j["state"], j["exit_code"]) == ("failed", 3)
    assert "rank 1" in j["reason"] or "task 1" in j["reason"]
    # the supervisor exits once the agent acknowledged the result: soon after wait returns
    poll_until(lambda: node.supervisor_pids() == [], 10, "the supervisor to exit")
    assert node.status()["cpus"]["allocated"] == 0


def test_mpi_abort_records_the_aborting_ranks_code(node: Node, programs: dict[str, str]) -> None:
    node.start()
    job = node.submit(programs["hello"], opts=("--ntasks", "2", "--pmi", "pmi1", "--env",
                                               "HELLO_ABORT_RANK=1"))
    j = node.wait_end(job, timeout=20)
    assert (j["state"], j["exit_code"]) == ("failed", 5)
    assert "abort" in j["reason"]


def test_pmi2_client_from_slurms_libpmi2(node: Node, programs: dict[str, str]) -> None:
    node.start()
    go = os.path.join(node.work, "go")
    job = node.submit(programs["pmi2"], opts=("--ntasks", "3", "--pmi", "pmi2", "--env",
                                              f"PMI2T_GO_FILE={go}"))
    poll_until(lambda: (s := _pmi(node, job)) and s["node_waits"] == {"nattr": [1, 2]},
               30, "ranks 1 and 2 to wait for a node attribute nobody has put yet")
    with open(go, "w"):
        pass
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0), j["reason"]
    assert _lines(j["output"]) == [f"rank {r} of 3 OK jobid={job}.1" for r in range(3)]


def test_pmi_variables_from_outside_are_cleared(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", 'echo "$PMI_PORT|$PMI_RANK|$PMI_SIZE|${PMI_FD:+fd}"',
                      opts=("--ntasks", "2", "--pmi", "pmi1", "--env", "PMI_PORT=elsewhere:1"))
    j = node.wait_end(job)
    assert j["state"] == "completed"
    assert _lines(j["output"]) == ["|0|2|fd", "|1|2|fd"]


def test_a_rank_exiting_0_without_pmi_breaks_the_barrier(node: Node,
                                                         programs: dict[str, str]) -> None:
    """Rank 1 never connects and exits 0; rank 0 would wait in MPI_Init's barrier forever."""
    node.start()
    job = node.submit("sh", "-c", f'[ "$PMI_RANK" = 1 ] && exit 0; exec {programs["hello"]}',
                      opts=("--ntasks", "2", "--pmi", "pmi1"))
    j = node.wait_end(job, timeout=20)
    assert j["state"] == "failed"
    assert "rank 1" in j["reason"], j["reason"]
    # the supervisor exits once the agent acknowledged the result: soon after wait returns
    poll_until(lambda: node.supervisor_pids() == [], 10, "the supervisor to exit")


def test_a_broken_pmi_stream_fails_without_blaming_the_killed_rank(node: Node) -> None:
    """Rank 0 speaks garbage on PMI_FD; the step ends failed with that reason, and the ranks
    the supervisor killed to end it are not reported as the cause (no SIGKILL result)."""
    node.start()
    # (bash: dash cannot redirect to an fd number above 9, and PMI_FD usually is one)
    job = node.submit("bash", "-c", 'if [ "$PMI_RANK" = 0 ]; then head -c 70000 /dev/zero | '
                                    'tr "\\0" x >&$PMI_FD; fi; sleep 30',
                      opts=("--ntasks", "2", "--pmi", "pmi1"))
    j = node.wait_end(job, timeout=20)
    assert j["state"] == "failed" and j["signal"] is None, j
    assert "PMI" in j["reason"]


def test_mpi_abort_with_code_0_is_still_a_failure(node: Node, programs: dict[str, str]) -> None:
    node.start()
    res = node.cli("submit", "--wait", "--ntasks", "2", "--pmi", "pmi1", "--", "bash", "-c",
                   'if [ "$PMI_RANK" = 1 ]; then printf "cmd=init pmi_version=1 '
                   'pmi_subversion=1\\ncmd=abort exitcode=0\\n" >&$PMI_FD; fi; sleep 30')
    assert res.returncode == 1, res
    j = node.job(int(res.stdout.split()[0]))
    assert (j["state"], j["exit_code"]) == ("failed", 1)


def test_a_fifo_as_output_fails_the_launch_instead_of_hanging(node: Node) -> None:
    node.start()
    fifo = os.path.join(node.work, "fifo")
    os.mkfifo(fifo)
    job = node.submit("true", opts=("--output", fifo))
    j = node.wait_end(job, timeout=20)
    assert (j["state"], j["exit_code"]) == ("failed", 127)
    assert "cannot open output file" in j["reason"]


def test_exit_record_stays_small_with_a_long_command(node: Node) -> None:
    node.start()
    job = node.submit("/nonexistent/" + "x" * 100_000, opts=("--ntasks", "4"))
    j = node.wait_end(job, timeout=20)
    assert (j["state"], j["exit_code"]) == ("failed", 127)
    assert len(j["reason"]) <= 300
