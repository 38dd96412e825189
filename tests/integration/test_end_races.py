"""Commands racing a job's end say it ended (issue 27: N4, N5): `upgrade-supervisors` takes a
step that ended during the call for done, and `suspend` says the job ended rather than that the
node has no freezer.

Each window is held open on purpose: a supervisor that ended its step and exited while no agent
collected it (the run directory and exit record left behind), and a supervisor stopped after
its task died and its step's cgroup went, as its end removes it, before it told the agent."""

from __future__ import annotations

import contextlib
import os
import signal

from tests.helpers import Node, poll_until
from tests.integration.test_cgroup import needs_freezer, step_dirs
from tether.shared.procid import proc_stat


def test_upgrade_supervisors_takes_a_step_that_ended_meanwhile_for_done(
        make_node: type[Node]) -> None:
    node = make_node(extra=["--linger", "0.5"])
    node.start()
    gate = os.path.join(node.work, "gate")
    job = node.submit("sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.02; done")
    node.wait_state(job, ("running",))
    node.stop()  # the step goes on alone; nobody collects its result
    open(gate, "w").close()
    rd = node.layout.run_dir(job, 1)
    # its exit record written, it lingers 0.5 s for an agent, then exits: as a step found at
    # the start of the call that ends before its turn comes
    poll_until(lambda: os.path.exists(rd.sentinel) and not node.supervisor_pids(), 30,
               "the step to end and its supervisor to exit")
    res = node.cli("upgrade-supervisors", str(job))
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"job {job}: its step ended during the upgrade; left as it is\n"
    # a job that never had a run directory here is still an error
    res = node.cli("upgrade-supervisors", "999")
    assert res.returncode == 1 and "no supervisor" in res.stderr, res
    node.start()
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0), j


@needs_freezer
def test_a_suspend_racing_the_jobs_end_says_it_ended(node: Node) -> None:
    node.start()
    job = node.submit("sleep", "60")
    j = node.wait_state(job, ("running",))
    sup, task = j["supervisor_pid"], j["pids"][0]
    os.kill(sup, signal.SIGSTOP)
    try:
        os.kill(task, signal.SIGKILL)
        poll_until(lambda: (st := proc_stat(task)) is None or st.dead, 10, "the task to die")

        def removed() -> bool:  # what the supervisor does at its step's end (reaping.py)
            for path in step_dirs(node, job):
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(path)
            return not any(os.path.isdir(p) for p in step_dirs(node, job))
        poll_until(removed, 10, "the step's cgroup to be removed")
        res = node.cli("suspend", str(job))
        assert res.returncode == 1, res
        assert res.stderr == f"tether: job {job} has ended: there is nothing to suspend\n", \
            res.stderr
    finally:
        os.kill(sup, signal.SIGCONT)
    j = node.wait_end(job)
    assert (j["state"], j["signal"]) == ("failed", signal.SIGKILL), j
    assert "suspended_at" not in j or j.get("state") != "suspended"
