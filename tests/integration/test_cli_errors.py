"""Bad CLI input: a non-zero exit, exactly one line on stderr, and nothing queued or changed."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.helpers import Node

USAGE = 2
ERROR = 1


def one_line(res: subprocess.CompletedProcess[str]) -> str:
    err = res.stderr.rstrip("\n")
    assert err, f"no error message on stderr (stdout: {res.stdout!r})"
    assert "\n" not in err, f"stderr is not one line: {err!r}"
    assert "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def busy() -> Iterator[tuple[Node, int]]:
    """One agent for the whole module, holding one ended job so the list is not trivially []."""
    n = Node()
    try:
        n.start()
        job = n.submit("true")
        assert n.wait_end(job)["state"] == "completed"
        yield n, job
    finally:
        n.cleanup()


CASES = [
    # (argv, expected exit code or None for "any non-zero", fragment expected in stderr)
    (["show", "4242"], ERROR, "no job 4242"),
    (["show", "4242", "--json"], ERROR, "no job 4242"),
    (["wait", "4242"], ERROR, "no job 4242"),
    (["wait", "4242", "--timeout", "1"], ERROR, "no job 4242"),
    (["cancel", "4242"], ERROR, "no job 4242"),
    (["inspect", "4242"], ERROR, "job 4242"),
    (["show", "abc"], USAGE, "is not a job id"),
    (["cancel", "0"], USAGE, "is not a job id"),
    (["submit", "--cpus", "0", "--", "true"], USAGE, "at least 1"),
    (["submit", "--cpus", "-1", "--", "true"], USAGE, "at least 1"),
    (["submit", "--cpus", "abc", "--", "true"], USAGE, "not a whole number"),
    (["submit", "--ntasks", "0", "--", "true"], USAGE, "at least 1"),
    (["submit", "--gpus", "-2", "--", "true"], USAGE, "negative"),
    (["submit", "--env", "NOEQUALS", "--", "true"], USAGE, "KEY=VALUE"),
    (["submit", "--cpus", "64", "--", "true"], ERROR, "needs 64 CPUs but this node has 4"),
    (["submit", "--ntasks", "3", "--cpus", "2", "--", "true"], ERROR,
     "needs 6 CPUs but this node has 4"),
    (["submit", "--gpus", "1", "--", "true"], ERROR, "GPUs"),
    (["submit", "--"], USAGE, "missing the command"),
    (["submit"], USAGE, "missing the command"),
    (["submit", "--cpus", "2"], USAGE, "missing the command"),
    (["submit", "--workdir", "/nonexistent/tether/dir", "--", "true"], ERROR,
     "does not exist"),
    (["submit", "--output", "/nonexistent/tether/dir/out", "--", "true"], ERROR,
     "does not exist"),
    (["frobnicate"], USAGE, "is not a command"),
    (["status", "--bogus"], USAGE, "unrecognized arguments"),
    (["wait", "1", "--timeout", "-3"], USAGE, "seconds"),
]


@pytest.mark.parametrize("argv, code, fragment", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line_and_changes_nothing(busy: tuple[Node, int], argv: list[str],
                                                   code: int, fragment: str) -> None:
    node, _ = busy
    before = node.ok("list", "--json")
    res = node.cli(*argv)
    assert res.returncode != 0
    assert res.returncode == code, (res.returncode, res.stderr)
    err = one_line(res)
    assert fragment in err, err
    assert err.startswith("tether"), err
    assert node.ok("list", "--json") == before, "bad input changed the job list"
    assert node.status()["cpus"]["allocated"] == 0


def test_cancel_and_wait_of_a_known_job_still_work(busy: tuple[Node, int]) -> None:
    """The module's agent is healthy: the errors above are about the input, not the agent."""
    node, job = busy
    assert node.cli("wait", str(job)).returncode == 0
    assert json.loads(node.ok("show", str(job), "--json"))["id"] == job


@pytest.mark.parametrize("argv", [["status"], ["status", "--json"], ["list"],
                                  ["show", "1"], ["cancel", "1"], ["submit", "--", "true"]])
def test_no_agent_running_is_exit_1(node: Node, argv: list[str]) -> None:
    res = node.cli(*argv)
    assert res.returncode == ERROR, (res.returncode, res.stderr)
    err = one_line(res)
    assert "no agent is answering" in err, err
    if argv == ["status", "--json"]:
        assert json.loads(res.stdout)["running"] is False
    else:
        assert res.stdout == ""
