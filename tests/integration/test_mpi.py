"""Real MPI under tether's PMI server: MPICH (PMI-1) and Slurm's libpmi2 (PMI-2), clients no one
here wrote. The programs are in tests/mpi/ and are built once per session."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from tests.helpers import Node, poll_until

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi")
MPICC = "mpicc.mpich"


@pytest.fixture(scope="session")
def programs() -> Iterator[dict[str, str]]:
    # MPICH's own names: Debian's plain `mpicc` follows the alternatives, which an installed
    # Open MPI takes over (and Open MPI speaks no PMI-1/PMI-2: docs/pmi.md)
    for tool in (MPICC, "gcc"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: run scripts/setup.sh --tests (it installs mpich, "
                        "libmpich-dev and libpmi2-0-dev)")
    out = tempfile.mkdtemp(dir="/tmp", prefix="ttmpi")
    built = {"hello": os.path.join(out, "hello_mpi"), "pmi2": os.path.join(out, "pmi2_client")}
    subprocess.run([MPICC, "-O1", "-o", built["hello"], os.path.join(HERE, "hello_mpi.c")],
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


#: A rank speaking PMI-1 on its PMI_FD by hand: init, 900-byte puts until one is refused, then
#: a get of its first key and finalize; it prints what it was told.
PUTTER = r'''
import os, socket
s = socket.socket(fileno=int(os.environ["PMI_FD"]))
buf = b""
def ask(line):
    global buf
    s.sendall(line.encode() + b"\n")
    while b"\n" not in buf:
        buf += s.recv(4096)
    reply, _, buf = buf.partition(b"\n")
    return reply.decode()
assert ask("cmd=init pmi_version=1 pmi_subversion=1").endswith("rc=0")
kvs = ask("cmd=get_my_kvsname").split("kvsname=")[1]
n = 0
while n < 100000:
    last = ask(f"cmd=put kvsname={kvs} key=k{n} value={'v' * 900}")
    if "rc=0" not in last:
        break
    n += 1
print("puts", n)
print(last)
print(ask(f"cmd=get kvsname={kvs} key=k0")[:60])
print(ask("cmd=finalize"))
'''


def test_a_ranks_puts_past_the_pmi_store_limit_are_refused(make_node: type[Node]) -> None:
    """The agent's --pmi-store-mb bounds what a step's ranks can make its (root) supervisor
    hold: a real rank's puts past 1 MiB are refused with a PMI-1 error reply naming the limit,
    and the rank carries on (its first key is still there) to a clean end."""
    from tether.supervisor.pmi import ENTRY_OVERHEAD

    node = make_node(extra=["--pmi-store-mb", "1"])
    node.start()
    job = node.submit(sys.executable, "-c", PUTTER, opts=("--pmi", "pmi1"))
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0), j
    with open(j["output"]) as f:
        puts, refusal, got, fin = f.read().splitlines()[:4]
    # each entry costs its key, its value and the overhead
    held = expected = 0
    while held + len(f"k{expected}") + 900 + ENTRY_OVERHEAD <= 1 << 20:
        held += len(f"k{expected}") + 900 + ENTRY_OVERHEAD
        expected += 1
    assert puts == f"puts {expected}", (puts, expected)
    assert refusal.startswith("cmd=put_result rc=-1 msg=KVS_put_refused:_the_step's_PMI_store_"
                              "is_full_(it_may_hold_1_MiB,"), refusal
    assert got.startswith("cmd=get_result rc=0 msg=success value=vvv"), got
    assert fin == "cmd=finalize_ack"
    assert j["pmi_unused"] is False


def test_pmi_variables_from_outside_are_cleared(node: Node) -> None:
    node.start()
    job = node.submit("sh", "-c", 'echo "$PMI_PORT|$PMI_RANK|$PMI_SIZE|${PMI_FD:+fd}"',
                      opts=("--ntasks", "2", "--pmi", "pmi1", "--env", "PMI_PORT=elsewhere:1",
                            "--error", "err-%j"))
    j = node.wait_end(job)
    assert j["state"] == "completed"
    assert _lines(j["output"]) == ["|0|2|fd", "|1|2|fd"]


def test_a_pmi_job_whose_ranks_never_speak_pmi_is_told_so(node: Node) -> None:
    """As an Open MPI binary under --pmi does (it has no PMI-1/PMI-2 client): every rank runs
    alone and the job completes. A warning in its error file and ``pmi_unused`` in the job
    object (``show``: pmi unused) say so; not for a job that spoke PMI, a cancelled one or one
    without --pmi."""
    node.start()
    job = node.submit("sh", "-c", 'echo "rank $PMI_RANK alone"',
                      opts=("--ntasks", "2", "--pmi", "pmi2", "--error", "err-%j"))
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"], j["pmi_unused"]) == ("completed", 0, True), j
    assert _lines(j["output"]) == ["rank 0 alone", "rank 1 alone"]
    with open(j["error"]) as f:
        assert f.read() == (
            f"tether: warning: job {job} asked for PMI (pmi2), but none of its ranks spoke PMI "
            "on PMI_FD: each ran alone, as rank 0 of 1. Its MPI needs a PMI-1 or PMI-2 client "
            "(MPICH, Intel MPI, MVAPICH; not Debian's Open MPI, which speaks PMIx only): see "
            "docs/pmi.md\n")
    shown = node.ok("show", str(job)).splitlines()
    assert "pmi            pmi2, unused: no rank spoke PMI (each ran alone; docs/pmi.md)" in \
        shown, shown
    # it used PMI (rank 0's init), or it was cancelled, or it did not ask: nothing to say
    spoke = node.submit("bash", "-c", 'if [ "$PMI_RANK" = 0 ]; then printf "cmd=init '
                        'pmi_version=1 pmi_subversion=1\\n" >&$PMI_FD; read -r _ <&$PMI_FD; fi',
                        opts=("--ntasks", "2", "--pmi", "pmi1"))
    cancelled = node.submit("sleep", "60", opts=("--pmi", "pmi1"))
    plain = node.submit("true")
    node.wait_state(cancelled, ("running",))
    node.ok("cancel", str(cancelled))
    for other in (spoke, cancelled, plain):
        o = node.wait_end(other)
        assert o["pmi_unused"] is False, o
        with open(o["error"]) as f:
            assert "tether: warning" not in f.read()
    assert not [line for line in node.ok("show", str(plain)).splitlines()
                if line.startswith("pmi")]


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
