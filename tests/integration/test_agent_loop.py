"""The agent's one loop: nothing that can hang runs on it. The user database (NSS, maybe LDAP)
is asked on the worker thread at launch, as at submit."""

from __future__ import annotations

import os
import subprocess

from tests.helpers import Node, poll_until
from tests.userkit import home_for, made_users, shared


def test_the_agent_answers_while_a_launch_waits_for_the_user_database(node: Node) -> None:
    # The launch's user lookup stops (test fault) until lookup.go exists, as a hung LDAP would.
    node.start(env={"TETHER_AGENT_FAULT": "hold-lookup"})
    job = node.submit("sh", "-c", "echo ran")
    poll_until(lambda: os.path.exists(os.path.join(node.state, "lookup.held")), 30,
               "the launch's user lookup to be under way")
    st = node.status()  # answered by the loop meanwhile
    assert st["cpus"]["allocated"] == 1
    assert node.job(job)["state"] == "starting"
    assert node.cli("cancel", "999").returncode == 1  # requests are served, not queued
    open(os.path.join(node.state, "lookup.go"), "w").close()
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0)
    assert node.status()["cpus"]["allocated"] == 0


def test_a_user_removed_while_the_launch_looks_it_up_fails_the_job(node: Node) -> None:
    with made_users(1) as (user,):
        shared(node)
        work = home_for(node, user)
        node.start(env={"TETHER_AGENT_FAULT": "hold-lookup"})
        job = node.submit("true", opts=("--user", user.name, "--workdir", work))
        poll_until(lambda: os.path.exists(os.path.join(node.state, "lookup.held")), 30,
                   "the launch's user lookup to be under way")
        subprocess.run(["userdel", user.name], check=True, capture_output=True)
        open(os.path.join(node.state, "lookup.go"), "w").close()
        j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("failed", None)
    assert j["reason"] == (f"could not start its supervisor: user {user.name!r} (uid {user.uid}) "
                           "no longer exists as submitted"), j["reason"]
    assert node.status()["cpus"]["allocated"] == 0
