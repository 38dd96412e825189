"""``agent --ksm``: the supervisor template's memory, and so every warm supervisor's, is marked
for kernel same-page merging, their tasks' is not (an exec ends the mark), a change of the
setting replaces the template, and an agent whose kernel does not merge says so and runs on."""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers import Node, poll_until
from tether.shared.procid import proc_stat

KSM = "/sys/kernel/mm/ksm"


def mergeable(pid: int) -> bool:
    """Whether any mapping of ``pid`` carries VM_MERGEABLE (``mg`` in smaps' VmFlags)."""
    with open(f"/proc/{pid}/smaps") as f:
        return any(ln.startswith("VmFlags:") and " mg" in ln for ln in f)


def ksmd_runs() -> bool:
    with open(os.path.join(KSM, "run")) as f:
        return f.read().strip() == "1"


def agent_log(node: Node) -> str:
    with open(node.agent_logs[-1]) as f:
        return f.read()


def pids_of(node: Node, job: int) -> tuple[int, int]:
    """The job's supervisor and its first task."""
    m = node.running_manifest(job)
    return int(m["supervisor"]["pid"]), int(m["tasks"][0]["pid"])


@pytest.mark.skipif(not os.path.exists(KSM), reason=f"no {KSM}: a kernel without KSM")
def test_ksm_marks_the_template_and_its_supervisors_but_not_their_tasks(node: Node) -> None:
    node.start()
    plain = node.wait_template()
    job = node.submit("sleep", "60")
    sup, task = pids_of(node, job)
    assert not mergeable(plain) and not mergeable(sup) and not mergeable(task)
    assert "--ksm" not in agent_log(node)

    # the setting is part of the template's identity: the next agent replaces it
    node.stop(signal.SIGKILL)
    node.args.append("--ksm")
    ksmd_before = ksmd_runs()
    node.start()
    poll_until(lambda: proc_stat(plain) is None or proc_stat(plain).dead, 20,
               "the template without --ksm to leave")
    template = node.wait_template()
    poll_until(lambda: mergeable(template), 20, "the template to mark its memory")
    job2 = node.submit("sleep", "60")
    sup2, task2 = pids_of(node, job2)
    assert mergeable(sup2), "a forked supervisor does not inherit the mark"
    assert not mergeable(task2), "a user's task is mergeable: the mark went through its exec"
    assert not mergeable(sup)  # started before: unchanged
    if not ksmd_before and not ksmd_runs():  # (a bench --ksm may switch it meanwhile)
        assert "--ksm has no effect until ksmd runs: echo 1 > " in agent_log(node)  # said only

    # the settings file says the same: the template is kept
    node.stop()
    config = os.path.join(node.dir, "agent.toml")
    with open(config, "w") as f:
        f.write("ksm = true\n")
    node.args.remove("--ksm")
    node.args += ["--config", config]
    node.start()
    assert node.wait_template() == template
    assert "kept" in agent_log(node)

    # and back: an agent without it replaces the marked template
    node.stop()
    node.args = node.args[:-2]
    node.start()
    poll_until(lambda: proc_stat(template) is None or proc_stat(template).dead, 20,
               "the --ksm template to leave")
    assert not mergeable(node.wait_template())
    for j in (job, job2):
        node.ok("cancel", str(j))
        assert node.wait_end(j)["state"] == "cancelled"
