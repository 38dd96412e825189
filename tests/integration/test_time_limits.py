"""Time limits (issue 13): the supervisor enforces them, so a job past its limit ends
``timeout`` whether or not an agent is there when it runs out."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

from tests.helpers import Node, poll_until, records


def inspect_state(node: Node, job: int) -> str:
    """The step's state from its supervisor (works with no agent)."""
    res = node.cli("inspect", str(job), "--json")
    if res.returncode != 0:
        return ""
    return str(json.loads(res.stdout).get("state"))


def test_a_job_past_its_limit_ends_timeout_and_wait_says_which_signal(node: Node) -> None:
    node.start()
    job = node.submit("sleep", "60", opts=("--time", "0:01"))
    res = node.cli("wait", str(job), "--timeout", "30")
    assert res.returncode == 128 + signal.SIGTERM, res.stderr
    j = node.job(job)
    assert (j["state"], j["signal"], j["time_limit"]) == ("timeout", signal.SIGTERM, 1)
    assert j["reason"].startswith("time limit of 00:00:01 reached")
    # a task that ignores SIGTERM gets SIGKILL after the grace (the node's --cancel-grace 2)
    stubborn = node.submit("sh", "-c", "trap '' TERM; sleep 60 & wait; sleep 60",
                           opts=("--time", "0:01"))
    assert node.cli("wait", str(stubborn), "--timeout", "30").returncode == 128 + signal.SIGKILL
    assert node.job(stubborn)["state"] == "timeout"
    # one that exits 0 when told to stop still did not complete: wait exits 1, not 0
    polite = node.submit("sh", "-c", "trap 'exit 0' TERM; sleep 60 & wait",
                         opts=("--time", "0:01"))
    assert node.cli("wait", str(polite), "--timeout", "30").returncode == 1
    assert (node.job(polite)["state"], node.job(polite)["exit_code"]) == ("timeout", 0)
    # and a job that ends in time is not touched
    quick = node.submit("true", opts=("--time", "1"))
    assert node.wait_end(quick)["state"] == "completed"


def test_the_limit_holds_across_an_agent_sigkill(node: Node) -> None:
    """One limit runs out while no agent exists; another, of a supervisor started before the
    restart, under the restarted agent. Both end ``timeout``."""
    node.start()
    early = node.submit("sleep", "60", opts=("--time", "0:02"))
    late = node.submit("sleep", "60", opts=("--time", "0:07"))
    for job in (early, late):
        node.wait_state(job, ("running",))
    node.stop(signal.SIGKILL)
    poll_until(lambda: inspect_state(node, early) == "timeout", 30,
               "the first job's supervisor to end it at its limit with no agent")
    sentinel = records.read_sentinel(node.layout.run_dir(early, 1).sentinel)
    assert (sentinel["state"], sentinel["signal"]) == ("timeout", signal.SIGTERM)
    node.start()
    assert node.job(late)["state"] == "running", "the second limit ran out before the restart"
    for job in (early, late):
        assert node.cli("wait", str(job), "--timeout", "30").returncode == 128 + signal.SIGTERM
        j: dict[str, Any] = node.job(job)
        assert (j["state"], j["signal"]) == ("timeout", signal.SIGTERM), j


def test_the_limit_crosses_a_supervisor_re_exec(node: Node) -> None:
    """``upgrade-supervisors`` hands the armed limit to the new image (handover ``timers``)."""
    node.start()
    job = node.submit("sleep", "60", opts=("--time", "0:03"))
    node.wait_state(job, ("running",))
    res = node.cli("upgrade-supervisors", str(job))
    assert res.returncode == 0, res.stderr + node.logs()
    assert node.cli("wait", str(job), "--timeout", "30").returncode == 128 + signal.SIGTERM
    assert node.job(job)["state"] == "timeout"


def test_node_default_and_maximum(make_node: Any) -> None:
    node: Node = make_node(cpus=1)
    config = os.path.join(node.dir, "agent.toml")  # the maximum from the settings file
    with open(config, "w") as f:
        f.write('max-time = "5"\ndefault-time = "9"\n')
    node.args += ["--config", config, "--default-time", "0:01"]  # the line wins over the file
    node.start()
    job = node.submit("sleep", "60")  # no --time: the node's default
    assert node.job(job)["time_limit"] == 1
    assert node.cli("wait", str(job), "--timeout", "30").returncode == 128 + signal.SIGTERM
    res = node.cli("submit", "--time", "6", "--", "true")
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        "tether: time limit 00:06:00 is over node "
        f"{node.status()['node']}'s maximum of 00:05:00"]
    bad = node.cli("submit", "--time", "1h", "--", "true")
    assert bad.returncode == 2 and "not a time limit" in bad.stderr
    assert len(json.loads(node.ok("list", "--json"))) == 1  # nothing else recorded
