"""Arrays and dependencies as Slurm's (issue 28, point 4), with a real agent: a dependency on an
array's id is on all its elements together (``afterok`` once every one completed, never once
one failed; ``afternotok`` once every one ended and one did not complete; ``afterany``),
``aftercorr`` pairs elements by index, ``singleton`` runs one job of a user and name at a time;
an element's environment has the array's ``TETHER_ARRAY_*`` variables, and Slurm's names of
the job variables only with ``--export-slurm-env``. (The rules are tabled over the pure
function in test_schedule.py.)"""

from __future__ import annotations

import os
from typing import Any

from tests.helpers import Node

#: an element waits for its gate, then fails if its index is 1
ELEMENT = ('while [ ! -e "gate-$TETHER_ARRAY_TASK_ID" ]; do sleep 0.05; done; '
           '[ "$TETHER_ARRAY_TASK_ID" != 1 ]')


def reason(node: Node, job: int) -> str:
    return str(node.job(job)["reason"])


def opened(node: Node, name: str) -> None:
    open(os.path.join(node.work, name), "w").close()


def test_one_failed_element_cancels_afterok_and_satisfies_afternotok_once_all_ended(
        make_node: Any) -> None:
    node: Node = make_node(cpus=8)
    node.start()
    array = int(node.ok("submit", "--array", "0-2", "--", "sh", "-c", ELEMENT).strip())
    ok = node.submit("true", opts=("--dependency", f"afterok:{array}"))
    notok = node.submit("true", opts=("--dependency", f"afternotok:{array}"))
    anyway = node.submit("true", opts=("--dependency", f"afterany:{array}_*"))
    corr = int(node.ok("submit", "--array", "0-2", "--dependency", f"aftercorr:{array}",
                       "--", "true").strip())
    assert node.job(ok)["dependency"] == [f"afterok:{array}_*"]  # Slurm's spelling
    for job in (ok, notok, anyway, corr, corr + 1, corr + 2):
        assert reason(node, job) == "Dependency"

    opened(node, "gate-1")  # element 1 fails; 0 and 2 run on
    assert node.wait_end(array + 1)["state"] == "failed"
    j = node.wait_state(ok, ("cancelled",))  # can no longer be met: cancelled at once
    assert j["reason"] == "DependencyNeverSatisfied"
    assert node.wait_state(corr + 1, ("cancelled",))["reason"] == "DependencyNeverSatisfied"
    # afternotok is met only once every element has ended (Slurm's): not yet
    assert (node.job(notok)["state"], reason(node, notok)) == ("pending", "Dependency")
    assert reason(node, anyway) == "Dependency"
    assert (node.job(corr)["state"], node.job(corr + 2)["state"]) == ("pending", "pending")

    opened(node, "gate-0")  # (an array's id waits for every element: its first, by state)
    assert node.wait_state(array, ("completed",))["state"] == "completed"
    assert node.wait_state(corr, ("completed",))["state"] == "completed"  # its own element
    assert node.job(notok)["state"] == "pending"
    assert node.job(corr + 2)["state"] == "pending"
    opened(node, "gate-2")
    for job in (notok, anyway, corr + 2):
        assert node.wait_state(job, ("completed", "failed", "cancelled"))["state"] == \
            "completed", node.job(job)


def test_an_array_that_all_completed_never_satisfies_afternotok(make_node: Any) -> None:
    node: Node = make_node(cpus=4)
    node.start()
    array = int(node.ok("submit", "--array", "0-1", "--", "true").strip())
    notok = node.submit("true", opts=("--dependency", f"afternotok:{array}"))
    ok = node.submit("true", opts=("--dependency", f"afterok:{array}"))
    assert node.wait_end(ok)["state"] == "completed"
    j = node.wait_state(notok, ("cancelled",))
    assert j["reason"] == "DependencyNeverSatisfied"


def test_singleton_runs_one_job_of_a_user_and_name_at_a_time(make_node: Any) -> None:
    node: Node = make_node(cpus=8)
    node.start()
    gated = 'while [ ! -e "go-$TETHER_JOB_ID" ]; do sleep 0.05; done'
    solo = [node.submit("sh", "-c", gated, opts=("-J", "solo", "-d", "singleton"))
            for _ in range(3)]
    other = node.submit("sh", "-c", gated, opts=("-J", "other", "-d", "singleton"))
    node.wait_state(solo[0], ("running",))
    node.wait_state(other, ("running",))  # another name: not in the way
    assert node.job(solo[0])["dependency"] == ["singleton"]
    for job in solo[1:]:
        assert (node.job(job)["state"], reason(node, job)) == ("pending", "Dependency")
    for k, job in enumerate(solo):
        opened(node, f"go-{job}")
        assert node.wait_end(job)["state"] == "completed"
        if k + 1 < len(solo):
            node.wait_state(solo[k + 1], ("running",))
            for later in solo[k + 2:]:
                assert node.job(later)["state"] == "pending"
    opened(node, f"go-{other}")
    assert node.wait_end(other)["state"] == "completed"


def env_of(node: Node, path: str) -> dict[str, str]:
    with open(path) as f:
        return dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)


def test_array_variables_and_slurm_names_only_on_request(node: Node) -> None:
    node.start()
    node.env["TETHER_ARRAY_TASK_MIN"] = "inherited"  # from an outer job: never the new one's
    array = int(node.ok("submit", "--array", "1-7:2", "-n", "2", "-o", "env-%a.%t",
                        "--", "env").strip())
    assert node.cli("wait", str(array), "--timeout", "60").returncode == 0
    env = env_of(node, os.path.join(node.work, "env-5.1"))
    assert {k: v for k, v in env.items() if k.startswith("TETHER_ARRAY_")} == {
        "TETHER_ARRAY_JOB_ID": str(array), "TETHER_ARRAY_TASK_ID": "5",
        "TETHER_ARRAY_TASK_COUNT": "4", "TETHER_ARRAY_TASK_MIN": "1",
        "TETHER_ARRAY_TASK_MAX": "7", "TETHER_ARRAY_TASK_STEP": "2"}
    assert not [k for k in env if k.startswith("SLURM")], env  # never by default
    single = node.submit("env", opts=("-o", "single.env"))
    assert node.wait_end(single)["state"] == "completed"
    assert not [k for k in env_of(node, os.path.join(node.work, "single.env"))
                if k.startswith("TETHER_ARRAY_")]

    array = int(node.ok("submit", "--array", "3-4", "-n", "2", "-c", "1", "--mem", "64M",
                        "--export-slurm-env", "-J", "named", "-o", "slurm-%a.%t",
                        "--", "env").strip())
    assert node.cli("wait", str(array), "--timeout", "60").returncode == 0
    env = env_of(node, os.path.join(node.work, "slurm-4.1"))
    element = array + 1
    want = {"SLURM_JOB_ID": str(element), "SLURM_JOBID": str(element),
            "SLURM_JOB_NAME": "named", "SLURM_NTASKS": "2", "SLURM_NPROCS": "2",
            "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
            "SLURM_ARRAY_JOB_ID": str(array), "SLURM_ARRAY_TASK_ID": "4",
            "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_MIN": "3",
            "SLURM_ARRAY_TASK_MAX": "4", "SLURM_ARRAY_TASK_STEP": "1",
            "SLURM_CPUS_PER_TASK": "1", "SLURM_MEM_PER_NODE": "64",
            "SLURM_SUBMIT_DIR": node.work}
    assert {k: env.get(k) for k in want} == want
    assert env["SLURMD_NODENAME"] == env["SLURM_JOB_NODELIST"] != ""
