"""Output file names: Slurm's tokens, per-task files, names that never collide, and the reason a
command could not run written where its output goes.

Issue 13, friction 6 (ids restart with each state dir and the default name collided between
agents; only %j expanded) and friction 8 (a command that cannot run leaves its output empty).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from tests.helpers import Node, poll_until
from tether.shared.outpattern import for_job, for_task, per_task

VALUES = {"j": "42", "x": "name", "u": "alice", "A": "40", "a": "2", "N": "n1"}


@pytest.mark.parametrize("pattern, recorded, rank0, rank3", [
    ("out-%j.txt", "out-42.txt", "out-42.txt", "out-42.txt"),
    ("%x_%u_%N_%A_%a", "name_alice_n1_40_2", "name_alice_n1_40_2", "name_alice_n1_40_2"),
    ("%5j-%3a", "00042-002", "00042-002", "00042-002"),
    ("r%t.out", "r%t.out", "r0.out", "r3.out"),
    ("r%2t.out", "r%2t.out", "r00.out", "r03.out"),
    ("100%%-%j", "100%%-42", "100%-42", "100%-42"),
    ("lit%%t", "lit%%t", "lit%t", "lit%t"),  # an escaped %t is not per task
    ("%q%", "%q%", "%q%", "%q%"),  # anything else stays as it is
])
def test_tokens(pattern: str, recorded: str, rank0: str, rank3: str) -> None:
    assert for_job(pattern, VALUES) == recorded
    assert for_task(recorded, 0) == rank0 and for_task(recorded, 3) == rank3
    assert per_task(recorded) == (rank0 != rank3)


def test_a_percent_in_a_value_stays_literal() -> None:
    recorded = for_job("%x.%t", dict(VALUES, x="50%t"))
    assert recorded == "50%%t.%t"
    assert for_task(recorded, 1) == "50%t.1"


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node(cpus=2, extra=["--node", "alpha"])
    try:
        n.start()
        yield n
    finally:
        n.cleanup()


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_tokens_and_per_task_files_in_a_real_job(node: Node) -> None:
    job = node.submit("sh", "-c", 'echo "rank $TETHER_TASK_ID"; echo "err $TETHER_TASK_ID" >&2',
                      opts=("--ntasks", "2", "--name", "nm", "--output", "o-%j-%x-%u-%N-%t.txt",
                            "--error", "e-%A-%a-%t-100%%.txt"))
    assert node.wait_end(job)["state"] == "completed"
    for rank in (0, 1):
        assert read(os.path.join(node.work, f"o-{job}-nm-root-alpha-{rank}.txt")) == \
            f"rank {rank}\n"
        assert read(os.path.join(node.work, f"e-{job}-0-{rank}-100%.txt")) == f"err {rank}\n"
    shown = node.job(job)
    assert shown["output"] == os.path.join(node.work, f"o-{job}-nm-root-alpha-%t.txt")

    # introspection follows the first task's files
    live = node.submit("sh", "-c", 'echo "rank $TETHER_TASK_ID"; exec sleep 60',
                       opts=("--ntasks", "2", "--output", "live-%t"))
    poll_until(lambda: all(os.path.exists(os.path.join(node.work, f"live-{r}")) and read(
        os.path.join(node.work, f"live-{r}")) for r in (0, 1)), 30, "both tasks to print")
    assert node.ok("inspect", str(live), "--output") == "rank 0\n"
    node.ok("cancel", str(live))


def test_default_names_of_two_agents_never_collide() -> None:
    """Each state dir numbers its jobs from 1: the node name in the default keeps them apart."""
    a, b = Node(cpus=1, extra=["--node", "na"]), Node(cpus=1, extra=["--node", "nb"])
    try:
        a.start()
        b.start()
        b.work = a.work  # one shared working directory
        ja = a.submit("echo", "from a")
        jb = b.submit("echo", "from b")
        assert ja == jb == 1
        a.wait_end(ja)
        b.wait_end(jb)
        assert read(os.path.join(a.work, "tether-na-1.out")) == "from a\n"
        assert read(os.path.join(a.work, "tether-nb-1.out")) == "from b\n"
    finally:
        a.cleanup()
        b.cleanup()


def test_ids_are_never_reused_across_restarts(node: Node) -> None:
    first = node.submit("true")
    node.wait_end(first)
    node.stop(signal.SIGKILL)
    node.start()
    second = node.submit("true")
    assert second > first
    node.wait_end(second)


@pytest.mark.parametrize("command, fragment", [
    (["/nonexistent/prog"], "cannot execute '/nonexistent/prog'"),
    (["/tmp"], "Permission denied"),
])
def test_a_command_that_cannot_run_says_why_in_its_error_file(node: Node, command: list[str],
                                                             fragment: str) -> None:
    job = node.submit(*command, opts=("--output", "o-%j", "--error", "e-%j"))
    ended = node.wait_end(job)
    assert ended["state"] == "failed" and ended["exit_code"] == 127
    err = read(os.path.join(node.work, f"e-{job}"))
    assert err.startswith("tether: task 0: ") and fragment in err and err.count("\n") == 1
    assert fragment in ended["reason"]
    assert read(os.path.join(node.work, f"o-{job}")) == ""


def test_a_missing_directory_in_an_expanded_name_is_refused(node: Node) -> None:
    res = node.cli("submit", "--output", "nodir-%j/out", "--", "true")
    assert res.returncode == 1 and "its directory does not exist" in res.stderr
    assert node.ok("list", "--json") == "[]\n"
