"""The node's hwloc topology, gathered once by the agent and loaded by MPI ranks as XML
(agent/topology.py): who gets it, that hwloc really loads it, that any user's ranks can, that the
job's own HWLOC_XMLFILE wins, and that without lstopo the ranks discover it as before."""

from __future__ import annotations

import os
import shutil
import stat
from typing import Any

import pytest

from tests import needs
from tests.helpers import Node, poll_until
from tests.integration.test_mpi import programs  # noqa: F401  (the MPICH hello, built once per session)
from tests.userkit import cli_as, home_for, made_users, ok_as, shared


@pytest.fixture(autouse=True)
def _lstopo() -> None:
    needs.tool("lstopo-no-graphics", "hwloc-nox")


#: an info attribute no discovery would produce: seen in a task's own hwloc view only if its
#: hwloc loaded the agent's file
MARK = "TetherTopologyTest"
#: what each task prints: its hwloc variables, then how many times its topology has MARK
PROBE = ('echo "xml=${HWLOC_XMLFILE-unset} this=${HWLOC_THISSYSTEM-unset} '
         'allowed=${HWLOC_THISSYSTEM_ALLOWED_RESOURCES-unset}"; '
         f'echo "mark=$(lstopo-no-graphics --of xml - | grep -c {MARK})"')


def gathered(node: Node) -> str:
    path: str = poll_until(lambda: node.status().get("hwloc_xml"), 30,
                           "the agent to gather the node's topology")
    return path


def mark(path: str) -> None:
    """Add MARK to the machine object of the agent's XML, as the test's own edit."""
    with open(path) as f:
        lines = f.read().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines)
              if line.lstrip().startswith('<object type="Machine"'))
    lines.insert(at + 1, f'      <info name="{MARK}" value="1"/>\n')
    with open(path, "w") as f:
        f.write("".join(lines))


def output(node: Node, job: int) -> list[str]:
    """The job's output, without the warning a PMI step whose ranks never spoke PMI (PROBE's)
    gets in its error file, which is its output here."""
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0), j["reason"]
    with open(j["output"]) as f:
        return [line for line in f.read().splitlines()
                if not line.startswith("tether: warning: ")]


def run(node: Node, *opts: str) -> list[str]:
    return output(node, node.submit("sh", "-c", PROBE, opts=opts))


def test_pmi_ranks_load_the_agents_xml_and_other_steps_do_not(node: Node) -> None:
    node.start()
    path = gathered(node)
    assert path == os.path.join(node.state, "topology.xml")
    st = os.stat(path)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.getuid(), 0o644)
    mark(path)
    ranks = run(node, "--ntasks", "2", "--pmi", "pmi1")
    assert sorted(ranks) == ["mark=1"] * 2 + [f"xml={path} this=1 allowed=1"] * 2, ranks
    assert run(node) == ["xml=unset this=unset allowed=unset", "mark=0"]
    # the job's own choice wins, whatever it is
    own = os.path.join(node.dir, "own.xml")
    shutil.copy(path, own)
    with open(own, "r+") as f:
        text = f.read().replace(MARK, MARK + "x")
        f.seek(0)
        f.write(text)
    assert run(node, "--pmi", "pmi2", "--env", f"HWLOC_XMLFILE={own}") == [
        f"xml={own} this=unset allowed=unset", "mark=1"]


def test_a_real_mpi_job_runs_on_the_xml(node: Node, programs: dict[str, str]) -> None:  # noqa: F811
    node.start()
    gathered(node)
    lines = output(node, node.submit(programs["hello"], opts=("--ntasks", "2", "--pmi", "pmi1")))
    assert sorted(lines) == ["rank 0 of 2 OK (sum 2, from 1)", "rank 1 of 2 OK (sum 2, from 0)"]


@pytest.mark.parametrize("mode", ["all", "off"])
def test_hwloc_xml_all_gives_it_to_every_step_and_off_to_none(node: Node, mode: str) -> None:
    node.args += ["--hwloc-xml", mode]
    node.start()
    if mode == "all":
        path = gathered(node)
        assert run(node) == [f"xml={path} this=1 allowed=1", "mark=0"]
    else:
        # one job through the agent's whole start, then nothing was gathered, nothing offered
        assert run(node, "--pmi", "pmi1") == ["xml=unset this=unset allowed=unset", "mark=0"]
        assert node.status()["hwloc_xml"] is None
        assert not os.path.exists(os.path.join(node.state, "topology.xml"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_users_ranks_read_it(node: Node) -> None:
    with made_users(1) as (alice,):
        shared(node)
        work = home_for(node, alice)
        node.start()
        mark(gathered(node))
        job = int(ok_as(alice, node, "submit", "--ntasks", "2", "--pmi", "pmi1", "--", "sh",
                        "-c", PROBE, cwd=work))
        assert cli_as(alice, node, "wait", str(job), cwd=work).returncode == 0
        lines = output(node, job)
        assert sorted(lines)[:2] == ["mark=1", "mark=1"], lines


def test_without_lstopo_the_agent_says_so_and_mpi_still_runs(node: Node,
                                                              programs: dict[str, Any],  # noqa: F811
                                                              ) -> None:
    node.start(env={"TETHER_AGENT_FAULT": "no-lstopo"})
    # "the agent says so", once: the log line is the contract (status says it with None)
    poll_until(lambda: "no hwloc topology for MPI ranks" in node.logs(), 30,
               "the agent to say it has no topology")
    assert node.logs().count("no hwloc topology") == 1
    assert node.status()["hwloc_xml"] is None
    lines = output(node, node.submit(programs["hello"], opts=("--ntasks", "2", "--pmi", "pmi1")))
    assert len([line for line in lines if " OK " in line]) == 2
    assert run(node, "--pmi", "pmi1") == ["xml=unset this=unset allowed=unset", "mark=0"]
