"""Upgrades and rollbacks with jobs running, against real builds of release 0.1.0 (commit
72fa3ec) and 0.6.0 (installed in their own venvs by tests/releases.py): old agent -> new agent
-> old agent, old supervisors under the new agent and new ones under the old, each CLI against
the other's agent, and what a newer schema does to an older agent."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from typing import Any

import pytest

import tether
from tests.helpers import CLI, Node, default_output, pid_alive, poll_until
from tests.releases import release
from tether.agent import schema
from tether.cli.connect import agent_call
from tether.cli.errors import CliError
from tether.shared import protocol
from tether.shared.errors import VersionMismatch
from tether.shared.step_client import connect


@pytest.fixture(scope="module")
def old() -> list[str]:
    return [os.path.join(release(), "tether")]


@pytest.fixture
def skew_node(make_node: Any, old: list[str]) -> Node:
    """A node whose agent and CLI are release 0.1.0's until a test switches ``tether``."""
    n: Node = make_node()
    n.tether = old
    return n


def run(node: Node, tether_cmd: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*tether_cmd, *args], capture_output=True, text=True, env=node.env,
                          cwd=node.work, timeout=60)


def ok(node: Node, tether_cmd: list[str], *args: str) -> str:
    res = run(node, tether_cmd, *args)
    assert res.returncode == 0, f"{tether_cmd[0]} {' '.join(args)}: {res.stderr}\n{node.logs()}"
    assert "Traceback" not in res.stderr
    return res.stdout


def show(node: Node, tether_cmd: list[str], job: int) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(ok(node, tether_cmd, "show", str(job), "--json"))
    return result


def ticking(node: Node, tether_cmd: list[str]) -> int:
    """A job that ticks until the file ``gate`` appears in the work dir, then says done."""
    script = ("i=0; while [ ! -e gate ]; do i=$((i+1)); echo tick $i; sleep 0.05; done; "
              "echo done")
    return int(ok(node, tether_cmd, "submit", "--", "sh", "-c", script).strip())


def open_gate(node: Node) -> None:
    open(os.path.join(node.work, "gate"), "w").close()


def assert_ticked_whole(node: Node, job: int) -> None:
    """Every tick once, in order, then done: nothing lost or repeated across the upgrades."""
    with open(default_output(node.work, job)) as f:
        lines = f.read().splitlines()
    assert lines[-1] == "done" and len(lines) > 5
    assert lines[:-1] == [f"tick {i}" for i in range(1, len(lines))]


def user_version(node: Node) -> int:
    conn = sqlite3.connect(node.layout.db)
    try:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])
    finally:
        conn.close()


def test_old_agent_to_new_and_back_with_jobs_running(skew_node: Node, old: list[str]) -> None:
    node, new = skew_node, CLI
    node.start()  # release 0.1.0's agent
    assert json.loads(ok(node, old, "status", "--json"))["version"] == "0.1.0"
    tick_old = ticking(node, old)
    doomed = int(ok(node, old, "submit", "--", "sleep", "60").strip())
    fails = int(ok(node, old, "submit", "--", "sh", "-c", "sleep 1.5; exit 3").strip())
    for job in (tick_old, doomed, fails):
        poll_until(lambda j=job: show(node, old, j)["state"] == "running", 30, f"job {job} runs")

    # upgrade: the new agent adopts 0.1.0's supervisors and migrates the database in place
    node.stop()
    node.tether = new
    node.start()
    st = json.loads(ok(node, new, "status", "--json"))
    assert (st["version"], st["protocol"], st["schema"]) == (
        tether.__version__, protocol.PROTOCOL_VERSION, schema.SCHEMA_VERSION)
    assert user_version(node) == schema.SCHEMA_VERSION
    with connect(tick_old, state_dir=node.state) as step:
        assert step.hello["version"] == "0.1.0" and step.client.protocol == 1
    inspected = json.loads(ok(node, new, "inspect", str(tick_old), "--json"))
    assert inspected["state"] == "running" and inspected["info"]["version"] == "0.1.0"
    pids = json.loads(ok(node, new, "inspect", str(tick_old), "--pids", "--json"))
    assert [t["alive"] for t in pids["tasks"]] == [True]
    ok(node, new, "cancel", str(doomed))  # a 0.1.0 supervisor cancelled by the new agent
    # the old CLI against the new agent
    assert json.loads(ok(node, old, "status", "--json"))["version"] == tether.__version__
    assert {j["id"] for j in json.loads(ok(node, old, "list", "--json"))} >= {
        tick_old, doomed, fails}
    assert show(node, old, doomed)["state"] in ("running", "cancelled")
    assert run(node, old, "wait", str(fails), "--timeout", "30").returncode == 3
    assert run(node, new, "wait", str(doomed), "--timeout", "30").returncode != 124
    assert show(node, new, doomed)["state"] == "cancelled"
    tick_new = ticking(node, old)  # the old CLI submits to the new agent: a new supervisor
    poll_until(lambda: show(node, new, tick_new)["state"] == "running", 30, "the new job runs")

    # rollback: schema 1 is 0.1.0's, so its agent takes over again, new supervisor included
    node.stop()
    node.tether = old
    node.start()
    assert json.loads(ok(node, new, "status", "--json"))["version"] == "0.1.0"
    assert "protocol" not in json.loads(ok(node, new, "status", "--json"))  # ignored, not fatal
    open_gate(node)
    for job in (tick_old, tick_new):
        assert run(node, new, "wait", str(job), "--timeout", "60").returncode == 0
        assert_ticked_whole(node, job)
    assert show(node, new, fails)["exit_code"] == 3
    assert [j["state"] for j in json.loads(ok(node, new, "list", "--json"))] == [
        "completed", "cancelled", "failed", "completed"]
    # the new CLI submits to the old agent
    late = int(ok(node, new, "submit", "--", "sh", "-c", "exit 5").strip())
    assert run(node, new, "wait", str(late), "--timeout", "30").returncode == 5
    node.stop()


def test_new_cli_says_what_an_old_supervisor_cannot_do(
        skew_node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    node = skew_node
    node.start()
    job = int(ok(node, node.tether, "submit", "--", "sleep", "30").strip())
    poll_until(lambda: show(node, node.tether, job)["state"] == "running", 30, "the job runs")
    # a kind of protocol 2 (upgrade-supervisors' is one) is never sent to a 0.1.0 supervisor
    monkeypatch.setitem(protocol.KIND_SINCE, "newkind", 2)
    with connect(job, state_dir=node.state) as step:
        with pytest.raises(VersionMismatch) as info:
            step.call("newkind")
        assert info.value.message == f"job {job}'s supervisor is 0.1.0 and does not answer " \
                                     "'newkind'"
        # and a kind it lacks although the table says it is old: the same message
        with pytest.raises(VersionMismatch, match="is 0.1.0 and does not answer 'frobnicate'"):
            step.call("frobnicate")
        assert step.state()["state"] == "running"  # still fine for what it does answer
    res = run(node, CLI, "upgrade-supervisors", str(job))
    assert (res.returncode, res.stderr) == (
        1, f"tether: job {job}'s supervisor is 0.1.0 and does not answer 'upgrade'\n")
    # the CLI against the 0.1.0 agent: what it does not know, in one line naming both releases
    both = f"this CLI is tether {tether.__version__} (protocol {protocol.PROTOCOL_VERSION})"
    with pytest.raises(CliError) as err:
        agent_call(node.layout, "newkind", {})
    assert str(err.value) == f"the agent is tether 0.1.0 (protocol 1) and does not answer " \
                             f"'newkind'; {both}"
    with pytest.raises(CliError) as err:
        agent_call(node.layout, "submit", {"command": ["true"], "workdir": node.work,
                                           "future_option": 1})
    assert str(err.value).startswith("the agent is tether 0.1.0 (protocol 1) and refuses "
                                     "'submit': 'submit' got unknown arguments ['future_option']")
    assert str(err.value).endswith(both)
    # 0.5.0's scheduling against the 0.1.0 agent: refused by name, never dropped
    res = run(node, CLI, "hold", str(job))
    assert (res.returncode, res.stderr) == (
        1, f"tether: the agent is tether 0.1.0 (protocol 1) and does not answer 'hold'; {both}\n")
    res = run(node, CLI, "submit", "--time", "5", "--", "true")
    assert res.returncode == 1 and "unknown arguments ['time_limit']" in res.stderr, res.stderr
    assert len(json.loads(ok(node, CLI, "list", "--json"))) == 1  # nothing was recorded
    ok(node, node.tether, "cancel", str(job))


def test_an_older_agent_on_a_newer_schema_changes_and_runs_nothing(
        skew_node: Node, old: list[str]) -> None:
    """What a schema change (the next release's) does to rollback: 0.1.0 does not read the
    schema version, but it neither runs nor records anything on a table it does not know."""
    node = skew_node
    node.tether = CLI
    node.start()
    job = int(ok(node, CLI, "submit", "--", "sleep", "30").strip())
    poll_until(lambda: show(node, CLI, job)["state"] == "running", 30, "the job runs")
    node.stop()
    conn = sqlite3.connect(node.layout.db, isolation_level=None)  # the next release's migration
    conn.execute("ALTER TABLE jobs ADD COLUMN next_release TEXT")
    conn.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION + 1}")
    conn.close()
    with open(node.layout.db, "rb") as f:
        before = f.read()
    res = run(node, old, "agent", "--state-dir", node.state, "--cpus", "2")
    assert res.returncode != 0
    with open(node.layout.db, "rb") as f:
        assert f.read() == before
    assert not os.path.exists(node.layout.sock)
    # and the new agent refuses it outright, in one line
    res = run(node, CLI, "agent", "--state-dir", node.state, "--cpus", "2")
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    os.kill(show_pid(node, job), 0)  # the job's supervisor was left alone throughout


def show_pid(node: Node, job: int) -> int:
    return int(node.manifest(job)["supervisor"]["pid"])


#: the last build of release 0.6.0 before the agent's link became ZeroMQ on both ends (issue
#: 26): its supervisors serve ``ctl/sock`` with a door (ZMTP answered by hand), its agent speaks
#: native frames and falls back to a DEALER when it meets a libzmq ROUTER
RELEASE_0_6_0 = "3a6e8f4"


def threads(pid: int) -> int:
    """A supervisor of this release has libzmq's two threads beside its own; one of 0.6.0 has
    one: how the two, which both call themselves 0.6.0 until a release is cut, are told apart."""
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln.split()[1] for ln in f if ln.startswith("Threads:")))


def gated(node: Node, tether_cmd: list[str], gate: str) -> int:
    """A job that ticks until the file ``gate`` appears in the work dir, then says done."""
    script = (f"i=0; while [ ! -e {gate} ]; do i=$((i+1)); echo tick $i; sleep 0.05; done; "
              "echo done")
    return int(ok(node, tether_cmd, "submit", "--", "sh", "-c", script).strip())


def test_the_agent_of_0_6_and_this_one_drive_each_others_supervisors(make_node: Any) -> None:
    """Skew both ways with real processes: this release's agent reattaches to 0.6.0's
    supervisors (its DEALER to their ctl doors' ZMTP) and drives them to the end (cancel, wait,
    ack); 0.6.0's agent reattaches to this release's supervisors (its native frames refused
    by the ROUTER's greeting, then its DEALER) and drives them to the end too."""
    old = [os.path.join(release(RELEASE_0_6_0), "tether")]
    node: Node = make_node(cpus=2)  # (--oversubscribe is left out for other builds)
    node.tether = old
    node.start()
    tick_old = gated(node, old, "gate1")
    doomed_old = int(ok(node, old, "submit", "--", "sleep", "60").strip())
    for job in (tick_old, doomed_old):
        poll_until(lambda j=job: show(node, old, j)["state"] == "running", 30, f"job {job} runs")
    old_sup = show(node, old, tick_old)["supervisor_pid"]
    assert threads(old_sup) == 1  # a door, no ZeroMQ

    # this release's agent: the 0.6.0 supervisors reattached through a DEALER each
    node.stop()
    node.tether = CLI
    node.start()
    j = show(node, CLI, tick_old)
    assert (j["state"], j["supervisor_pid"]) == ("running", old_sup)
    ok(node, CLI, "cancel", str(doomed_old))  # ``terminate`` over ZMTP to a door
    assert node.wait_end(doomed_old)["state"] == "cancelled"
    open(os.path.join(node.work, "gate1"), "w").close()
    assert run(node, CLI, "wait", str(tick_old), "--timeout", "60").returncode == 0
    assert_ticked_whole(node, tick_old)  # ``wait`` answered, the result collected and acked
    poll_until(lambda: not pid_alive(old_sup), 20, "the acknowledged 0.6.0 supervisor to exit")

    tick_new = gated(node, CLI, "gate2")
    doomed_new = int(ok(node, CLI, "submit", "--", "sleep", "60").strip())
    for job in (tick_new, doomed_new):
        poll_until(lambda j=job: show(node, CLI, j)["state"] == "running", 30, f"job {job} runs")
    new_sup = show(node, CLI, tick_new)["supervisor_pid"]
    assert threads(new_sup) == 3  # a ROUTER: libzmq's I/O and reaper threads

    # 0.6.0's agent again: this release's supervisors reattached through its DEALER fallback
    node.stop()
    node.tether = old
    node.start()
    j = show(node, old, tick_new)
    assert (j["state"], j["supervisor_pid"]) == ("running", new_sup)
    ok(node, old, "cancel", str(doomed_new))  # ``terminate`` to the ROUTER
    assert run(node, old, "wait", str(doomed_new), "--timeout", "30").returncode != 124
    assert show(node, old, doomed_new)["state"] == "cancelled"
    open(os.path.join(node.work, "gate2"), "w").close()
    assert run(node, old, "wait", str(tick_new), "--timeout", "60").returncode == 0
    assert_ticked_whole(node, tick_new)
    poll_until(lambda: not pid_alive(new_sup), 20, "the acknowledged supervisor to exit")
    assert not os.path.exists(node.layout.run_dir(tick_new, 1).path)
    with open(node.agent_logs[-1]) as f:
        assert f"job {tick_new}: its supervisor serves ZeroMQ" in f.read()
    node.stop()
