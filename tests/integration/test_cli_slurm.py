"""Slurm's spellings of submit's options (issue 28, point 3): sbatch's short options, --mem with
units, --job-name, --chdir, --ntasks-per-node, --export, and a did-you-mean that finds the
option meant (a mistyped --mem used to suggest --time or --name)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import time
from typing import Any

import pytest

from tests.helpers import CLI, Node
from tether.cli.cmd_submit import USER_PATH
from tether.cli.errors import CliError
from tether.cli.parser import build_parser

USAGE = 2
#: a --begin date within the year it may be (a month from now, local time)
SOON = time.strftime("%Y-%m-%d", time.localtime(time.time() + 30 * 86400))


def argparse_vars(argv: list[str]) -> dict[str, Any] | None:
    """What ``tether`` makes of ``argv``, or None where it refuses it."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return vars(build_parser(argv).parse(argv))
        except (CliError, SystemExit):
            return None


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "TETHER_STATE_DIR": "/nonexistent/tt"})


@pytest.mark.parametrize("slurm, ours", [
    (["-n", "4"], ["--ntasks", "4"]), (["-n4"], ["--ntasks", "4"]),
    (["-c", "2"], ["--cpus", "2"]), (["--cpus-per-task=2"], ["--cpus", "2"]),
    (["-J", "sim"], ["--name", "sim"]), (["--job-name", "sim"], ["--name", "sim"]),
    (["-o", "o-%j"], ["--output", "o-%j"]), (["-e", "e"], ["--error", "e"]),
    (["-t", "1:00:00"], ["--time", "1:00:00"]), (["-D", "/tmp"], ["--workdir", "/tmp"]),
    (["--chdir", "/tmp"], ["--workdir", "/tmp"]), (["-G", "1"], ["--gpus", "1"]),
    (["-a", "0-3%2"], ["--array", "0-3%2"]), (["-d", "afterok:3"], ["--dependency", "afterok:3"]),
    (["-H", "-W"], ["--hold", "--wait"]), (["-b", SOON], ["--begin", SOON]),
    (["--mem", "512M"], ["--memory-mb", "512"]), (["--mem=4G"], ["--memory-mb", "4096"]),
    (["--mem", "2g"], ["--memory-mb", "2048"]), (["--mem", "1T"], ["--memory-mb", "1048576"]),
    (["--mem", "300"], ["--memory-mb", "300"]), (["--mem", "1025K"], ["--memory-mb", "2"]),
])
def test_slurm_spellings_mean_what_tether_s_own_mean(slurm: list[str], ours: list[str]) -> None:
    a = argparse_vars(["submit", *slurm, "--", "x"])
    b = argparse_vars(["submit", *ours, "--", "x"])
    assert a is not None and a == b, (a, b)


@pytest.mark.parametrize("argv, words", [
    (["--mem", "0"], "all of the node's memory"), (["--mem", "4GB"], "is not a size"),
    (["--mem", "1.5G"], "is not a size"), (["--export", "ALL,NONE"], "both ALL and NONE"),
    (["--export", "A=1,2"], "use --env"), (["-n", "0"], "at least 1"),
])
def test_bad_slurm_values_are_one_line_usage_errors(argv: list[str], words: str) -> None:
    res = cli("submit", *argv, "--", "true")
    assert res.returncode == USAGE and words in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("typo, meant", [
    ("--mme", "--mem"), ("--memory", "--mem"), ("--Mem", "--mem"), ("--mem-per-node", "--mem"),
    ("--walltime", "--time"), ("--cwd", "--chdir"), ("--jobname", "--job-name"),
    ("--cpu", "--cpus"), ("--ntask", "--ntasks"), ("--gres", "--gpus"), ("--tiem", "--time"),
])
def test_a_mistyped_option_suggests_the_one_meant(typo: str, meant: str) -> None:
    res = cli("submit", typo, "4", "--", "true")
    assert res.returncode == USAGE
    assert f"did you mean '{meant}'?" in res.stderr, res.stderr


def test_ntasks_per_node_is_the_number_of_tasks_on_the_one_node(node: Node) -> None:
    node.start()
    job = node.job(node.submit("true", opts=("--ntasks-per-node", "3")))
    assert job["ntasks"] == 3
    job = node.job(node.submit("true", opts=("-n", "2", "--ntasks-per-node", "2")))
    assert job["ntasks"] == 2
    res = node.cli("submit", "-n", "1", "--ntasks-per-node", "2", "--", "true")
    assert res.returncode == USAGE and "differ" in res.stderr, res.stderr


def test_a_slurm_command_line_runs_as_it_would_under_sbatch(node: Node) -> None:
    node.start()
    work = os.path.join(node.work, "sub")
    os.makedirs(work)
    node.env.update(KEEP="kept", DROP="dropped")
    script = 'echo "$TETHER_TASK_ID:$KEEP:$SET:${DROP-unset}:$PATH:$(pwd)"'
    job_id = int(node.ok("submit", "-n", "2", "-c", "1", "-J", "slurmy", "-o", "out-%j.%t",
                         "-D", work, "--mem", "64M", "-t", "5", "--export", "NONE,KEEP,SET=1",
                         "--", "sh", "-c", script).strip())
    job: dict[str, Any] = node.wait_end(job_id)
    assert job["state"] == "completed", job
    assert (job["name"], job["ntasks"], job["cpus_per_task"], job["memory_mb"],
            job["time_limit"], job["workdir"]) == ("slurmy", 2, 1, 64, 300, work)
    for rank in (0, 1):
        with open(os.path.join(work, f"out-{job_id}.{rank}")) as f:  # the job has ended
            assert f.read() == f"{rank}:kept:1:unset:{USER_PATH}:{work}\n"
    # the default stays ALL: the whole environment goes along
    job_id = node.submit("sh", "-c", 'echo "${DROP-unset}"', opts=("-o", "all.out"))
    assert node.wait_end(job_id)["state"] == "completed"
    with open(os.path.join(node.work, "all.out")) as f:
        assert f.read() == "dropped\n"
