"""A supervisor imports everything before its step starts, so replacing the installed package
under a running supervisor cannot break the rest of the step's life."""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers import Node


@pytest.mark.parametrize("start", ["warm", "cold"])
def test_supervisor_loads_no_module_after_start_up(node: Node, start: str) -> None:
    """Both ways a supervisor starts: forked from the template, or a Python start of its own."""
    node.env["TETHER_AUDIT_IMPORTS"] = "1"
    if start == "cold":
        node.env["TETHER_AGENT_FAULT"] = "no-template"
    node.start()
    if start == "warm":
        node.wait_template()
    ok = node.submit("true")
    bad = node.submit("sh", "-c", "exit 4")
    noexec = node.submit("/nonexistent/program")
    slow = node.submit("sh", "-c", "trap '' TERM; sleep 30")
    ticking = node.submit("sh", "-c", "sleep 1")
    node.wait_state(slow, ("running",))
    node.wait_state(ticking, ("running",))
    node.stop(signal.SIGKILL)
    node.start()  # reattach: hello, claim, wait, ack on every live supervisor
    node.ok("cancel", str(slow))
    for job in (ok, bad, noexec, slow, ticking):
        node.wait_end(job)
    assert node.job(noexec)["exit_code"] == 127
    with open(os.path.join(node.state, "supervisors.log")) as f:
        log = f.read()
    assert "step ended" in log  # the supervisors logged here: "late import" below can fail
    assert f"({start} start)" in log and f"({'cold' if start == 'warm' else 'warm'} start)" \
        not in log
    late = [line for line in log.splitlines() if "late import" in line]
    assert late == [], "supervisors imported modules after start-up:\n" + "\n".join(late)
