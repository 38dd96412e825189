"""Every local user submits as themselves against a root agent, and no user can harm another's
job or read through root's eyes (issue 7: attacks 6 to 13, and what users may do).

Users are created here with unique names and removed afterwards; their CLI runs as them, with
only the environment the test gives it."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from tests.helpers import CLI, Node, poll_until
from tests.userkit import User, cli_as, home_for, made_users, ok_as, run_as, shared

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")


@pytest.fixture
def two() -> Iterator[list[User]]:
    with made_users(2) as users:
        yield users


def test_a_user_submits_waits_lists_and_cancels_her_own_jobs(node: Node,
                                                             two: list[User]) -> None:
    alice, bob = two
    shared(node)
    work = home_for(node, alice)
    node.start(env={"AGENT_ONLY_SECRET": "agent"})
    script = 'id -u; id -g; id -G; env; echo "umask $(umask)"'
    job = int(ok_as(alice, node, "submit", "--", "sh", "-c", script, cwd=work,
                    env={"ALICE_VAR": "hers"}, umask=0o027))
    assert cli_as(alice, node, "wait", str(job), cwd=work).returncode == 0
    j = json.loads(ok_as(alice, node, "show", str(job), "--json"))
    assert (j["state"], j["user"], j["uid"]) == ("completed", alice.name, alice.uid)
    st = os.stat(j["output"])
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (alice.uid, alice.gid, 0o640)
    with open(j["output"]) as f:
        lines = f.read().splitlines()
    assert lines[:3] == [str(alice.uid), str(alice.gid), str(alice.gid)]
    assert "ALICE_VAR=hers" in lines and f"USER={alice.name}" in lines
    assert not any(line.startswith("AGENT_ONLY_SECRET") for line in lines), lines
    assert "umask 0027" in lines
    # everyone sees every job's public fields, as squeue shows them
    listed = ok_as(bob, node, "list")
    assert f"{job}" in listed and "completed" in listed
    assert json.loads(ok_as(bob, node, "show", str(job), "--json"))["user"] == alice.name
    # a running job of alice's: bob is refused everything that acts on it, and nothing changes
    long = int(ok_as(alice, node, "submit", "--", "sleep", "60", cwd=work))
    node.wait_state(long, ("running",))
    for verb in (["cancel", str(long)], ["wait", str(long), "--timeout", "1"],
                 ["inspect", str(long), "--pids"], ["signal", str(long), "KILL"],
                 ["attach", str(long)]):
        res = cli_as(bob, node, *verb)
        assert res.returncode == 1, (verb, res.stdout, res.stderr)
        assert "permission denied" in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr
    assert node.job(long)["state"] == "running"
    res = cli_as(bob, node, "submit", "--user", alice.name, "--", "true")
    assert res.returncode == 1 and "only root" in res.stderr
    ok_as(alice, node, "inspect", str(long), "--pids")
    ok_as(alice, node, "cancel", str(long))
    assert node.wait_end(long)["state"] == "cancelled"


def test_a_users_submission_is_held_to_the_same_checks(node: Node, two: list[User]) -> None:
    alice, _ = two
    shared(node)
    node.start()
    res = cli_as(alice, node, "submit", "--cpus", "64", "--", "true")
    assert res.returncode == 1 and "needs 64 CPUs" in res.stderr
    res = cli_as(alice, node, "submit", "--workdir", node.state, "--", "true")
    assert res.returncode == 1 and "cannot create" in res.stderr, res.stderr
    assert json.loads(node.ok("list", "--json")) == []


# ---- 6 and 9: code planted in a shared working directory ----------------------------------


def scratch(node: Node) -> str:
    path = os.path.join(node.dir, "scratch")
    os.mkdir(path)
    os.chmod(path, 0o1777)
    return path


def plant(bob: User, where: str, source: str) -> None:
    res = run_as(bob, ["-c", "import sys; open(sys.argv[1], 'w').write(sys.argv[2])",
                       os.path.join(where, "socket.py"), source])
    assert res.returncode == 0, res.stderr


def test_attack6_socket_py_planted_in_a_1777_workdir_is_never_run(node: Node,
                                                                  two: list[User]) -> None:
    alice, bob = two
    shared(node)
    work = scratch(node)
    marker = os.path.join(work, "PWNED")
    plant(bob, work, f"import os\nopen({marker!r}, 'w').write(str(os.getuid()))\n"
                     "raise SystemExit(3)\n")
    node.start()
    out = os.path.join(work, "out.txt")
    job = node.submit("echo", "fine", opts=("--user", alice.name, "--workdir", work,
                                             "--output", out))
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0), j
    assert not os.path.exists(marker), "the planted socket.py ran"
    with open(out) as f:
        assert f.read() == "fine\n"


#: A socket.py that, imported by an output opener started in the workdir, hands back O_PATH fds
#: on a file of the user's: the launch then failed halfway and the job stayed running, taskless.
WEDGE = """
import os, sys
_me = sys.modules[__name__]
sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]
del sys.modules["socket"]
import socket as _real
globals().update({k: v for k, v in vars(_real).items() if not k.startswith("__")})
open(".wedge", "a").close()
def send_fds(sock, buffers, fds, *rest):
    return _real.send_fds(sock, buffers, [os.open(".wedge", os.O_PATH) for _ in fds], *rest)
sys.modules["socket"] = _me
"""


def test_attack9_a_user_cannot_wedge_her_own_job(node: Node, two: list[User]) -> None:
    alice, _ = two
    shared(node)
    work = home_for(node, alice)
    plant(alice, work, WEDGE)
    node.start()
    job = node.submit("sleep", "1", opts=("--user", alice.name, "--workdir", work))
    j = node.wait_end(job, timeout=30)
    assert j["state"] == "completed" and j["pids"], j
    # and a cancel still ends a running job of hers at once
    job = node.submit("sleep", "60", opts=("--user", alice.name, "--workdir", work))
    node.wait_state(job, ("running",))
    node.ok("cancel", str(job))
    assert node.wait_end(job, timeout=30)["state"] == "cancelled"


# ---- 7: a state dir someone else made ------------------------------------------------------


def test_attack7_a_state_dir_made_by_another_user_is_refused(two: list[User]) -> None:
    _, bob = two
    base = tempfile.mkdtemp(dir="/tmp", prefix="tt7")
    try:
        os.chmod(base, 0o1777)  # like /tmp
        target = os.path.join(base, "rootfile")
        with open(target, "w") as f:
            f.write("root's own\n")
        state = os.path.join(base, "state")
        res = run_as(bob, ["-c", "import os, sys; os.mkdir(sys.argv[1]); "
                                 "os.symlink(sys.argv[2], os.path.join(sys.argv[1], "
                                 "'agent.lock'))", state, target])
        assert res.returncode == 0, res.stderr
        agent = subprocess.run([*CLI, "agent", "--state-dir", state, "--cpus", "1"],
                               capture_output=True, text=True, timeout=30)
        assert agent.returncode == 1, agent.stderr
        assert "refusing" in agent.stderr and len(agent.stderr.splitlines()) == 1
        with open(target) as f:
            assert f.read() == "root's own\n", "the agent wrote through the planted link"
        # the same with the directory open to others but owned by root
        own = os.path.join(base, "open")
        os.mkdir(own)
        os.chmod(own, 0o777)
        agent = subprocess.run([*CLI, "agent", "--state-dir", own, "--cpus", "1"],
                               capture_output=True, text=True, timeout=30)
        assert agent.returncode == 1 and "written by others" in agent.stderr, agent.stderr
    finally:
        subprocess.run(["rm", "-rf", base])


# ---- 8: the workdir swapped for a link while the job waits ----------------------------------


def test_attack8_workdir_swapped_for_a_link_is_entered_as_the_user(node: Node,
                                                                   two: list[User]) -> None:
    alice, _ = two
    shared(node)
    mine = home_for(node, alice, "mine")
    work = os.path.join(mine, "w")
    os.mkdir(work)
    os.chown(work, alice.uid, alice.gid)
    vault = os.path.join(node.dir, "vault")
    os.mkdir(vault, 0o700)
    with open(os.path.join(vault, "secret"), "w") as f:
        f.write("ROOT ONLY\n")
    os.chmod(os.path.join(vault, "secret"), 0o644)
    node.start()
    blocker = node.submit("sleep", "30", opts=("--cpus", "4"))
    node.wait_state(blocker, ("running",))
    out = os.path.join(mine, "out.txt")
    job = node.submit("cat", "secret", opts=("--user", alice.name, "--workdir", work,
                                             "--output", out, "--cpus", "4"))
    res = run_as(alice, ["-c", "import os, sys; os.rename(sys.argv[1], sys.argv[1] + '.old'); "
                               "os.symlink(sys.argv[2], sys.argv[1])", work, vault])
    assert res.returncode == 0, res.stderr
    node.ok("cancel", str(blocker))
    j = node.wait_end(job)
    assert j["state"] == "failed" and "cannot enter working directory" in j["reason"], j
    if os.path.exists(out):
        with open(out) as f:
            assert "ROOT ONLY" not in f.read()


# ---- 10: reading output back -------------------------------------------------------------


def test_attack10_roots_attach_fallback_reads_as_the_jobs_user(node: Node,
                                                               two: list[User]) -> None:
    alice, _ = two
    shared(node)
    mine = home_for(node, alice, "mine")
    logs = os.path.join(mine, "logs")
    os.mkdir(logs)
    os.chown(logs, alice.uid, alice.gid)
    vault = os.path.join(node.dir, "vault")
    os.mkdir(vault, 0o700)
    with open(os.path.join(vault, "out.txt"), "w") as f:
        f.write("mine\nTOP SECRET\n")
    node.start()
    out = os.path.join(logs, "out.txt")
    job = node.submit("sh", "-c", f"echo mine; sleep 1; mv {logs} {logs}.old; "
                                  f"ln -s {vault} {logs}; touch {mine}/swapped; sleep 60",
                      opts=("--user", alice.name, "--workdir", mine, "--output", out))
    node.wait_state(job, ("running",))
    attach = subprocess.Popen([*CLI, "attach", str(job)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=node.env)
    try:
        assert attach.stdout is not None
        assert attach.stdout.readline() == b"mine\n"
        poll_until(lambda: os.path.exists(os.path.join(mine, "swapped")), 30, "the swap")
        sup = node.supervisor_pids()
        assert len(sup) == 1
        os.kill(sup[0], signal.SIGKILL)  # attach must finish from the files on its own
        rest, err = attach.communicate(timeout=30)
    finally:
        if attach.poll() is None:
            attach.kill()
            attach.wait()
    assert b"TOP SECRET" not in rest, "root's attach read through the user's link"
    assert b"cannot be read" in err or b"Permission denied" in err, err


def test_attack10_output_readers_are_opened_as_the_user(node: Node, two: list[User]) -> None:
    """A file the owner may write but not read is not shown to her through the supervisor."""
    alice, _ = two
    shared(node)
    mine = home_for(node, alice, "mine")
    out = os.path.join(mine, "wo.txt")
    with open(out, "w"):
        pass
    os.chmod(out, 0o622)  # root's file: alice may write it, not read it
    node.start()
    job = node.submit("sh", "-c", "echo HIDDEN; sleep 60",
                      opts=("--user", alice.name, "--workdir", mine, "--output", out))
    node.wait_state(job, ("running",))
    poll_until(lambda: os.path.getsize(out) > 0, 30, "the output")
    res = cli_as(alice, node, "inspect", str(job), "--output")
    assert "HIDDEN" not in res.stdout, "the owner read a file she may only write"
    assert res.returncode == 1 and "cannot be read" in res.stderr, res.stderr
    node.ok("cancel", str(job))
    node.wait_end(job)


# ---- 11 and 12: environment and umask --------------------------------------------------------


def test_attack11_roots_environment_does_not_reach_a_user_job(node: Node,
                                                              two: list[User]) -> None:
    alice, _ = two
    shared(node)
    mine = home_for(node, alice, "mine")
    node.start(env={"AGENT_ONLY_SECRET": "agent"})
    node.env["ROOT_SHELL_SECRET"] = "root"
    job = node.submit("env", opts=("--user", alice.name, "--workdir", mine, "--env",
                                   "GIVEN=yes"))
    j = node.wait_end(job)
    with open(j["output"]) as f:
        env = f.read()
    assert "GIVEN=yes" in env and f"HOME={alice.home}" in env
    assert "ROOT_SHELL_SECRET" not in env and "AGENT_ONLY_SECRET" not in env, env


def test_attack12_output_files_take_the_submitters_umask(node: Node, two: list[User]) -> None:
    alice, _ = two
    shared(node)
    mine = home_for(node, alice, "mine")
    node.start()
    res = subprocess.run([*CLI, "submit", "--user", alice.name, "--workdir", mine, "--",
                          "true"], capture_output=True, text=True, env=node.env, umask=0o077)
    assert res.returncode == 0, res.stderr
    j = node.wait_end(int(res.stdout))
    assert stat.S_IMODE(os.stat(j["output"]).st_mode) == 0o600


# ---- 13: terminal escapes ------------------------------------------------------------------


def test_attack13_control_characters_are_escaped_in_what_the_cli_prints(
        node: Node, two: list[User]) -> None:
    alice, _ = two
    shared(node)
    mine = home_for(node, alice, "mine")
    node.start()
    evil = "\x1b]0;pwned\x07\x1b[2J"
    script = ('cp /bin/sleep "./$1"; "./$1" 60 & touch started; wait')
    job = node.submit("sh", "-c", script, "sh", evil,
                      opts=("--user", alice.name, "--workdir", mine, "--name", "n\x1b[31m"))
    poll_until(lambda: os.path.exists(os.path.join(mine, "started")), 30, "the job")
    poll_until(lambda: "pwned" in node.ok("inspect", str(job), "--pids"), 30, "the process")
    for argv in (["inspect", str(job), "--pids"], ["list"], ["show", str(job)],
                 ["inspect", str(job)]):
        shown = node.ok(*argv)
        assert "\x1b" not in shown and "\x07" not in shown, (argv, shown)
    assert "\\x1b]0;pwned" in node.ok("inspect", str(job), "--pids")
    node.ok("cancel", str(job))
    node.wait_end(job)


def test_only_the_owner_or_root_holds_releases_suspends_and_resumes(node: Node,
                                                                   two: list[User]) -> None:
    alice, bob = two
    shared(node)
    work = home_for(node, alice)
    node.start()
    job = int(ok_as(alice, node, "submit", "--hold", "--", "true", cwd=work))
    for verb in ("release", "hold", "cancel"):
        res = cli_as(bob, node, verb, str(job))
        assert res.returncode == 1 and "permission denied" in res.stderr, (verb, res.stderr)
        assert len(res.stderr.splitlines()) == 1
    assert json.loads(ok_as(bob, node, "show", str(job), "--json"))["reason"] == "JobHeldUser"
    ok_as(alice, node, "release", str(job))
    assert node.wait_end(job)["state"] == "completed"
    again = int(ok_as(alice, node, "submit", "--hold", "--", "true", cwd=work))
    node.ok("release", str(again))  # root may
    assert node.wait_end(again)["state"] == "completed"
    # nor suspends and resumes another's running job (refused before anything is frozen)
    running = int(ok_as(alice, node, "submit", "--", "sleep", "60", cwd=work))
    node.wait_state(running, ("running",))
    for verb in ("suspend", "resume"):
        res = cli_as(bob, node, verb, str(running))
        assert res.returncode == 1 and "permission denied" in res.stderr, (verb, res.stderr)
    assert node.job(running)["state"] == "running"  # (a suspended job shows "suspended")
    ok_as(alice, node, "cancel", str(running))
    assert node.wait_end(running)["state"] == "cancelled"
