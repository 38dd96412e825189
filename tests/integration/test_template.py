"""The warm supervisor template: supervisors forked from it are fresh processes, it outlives agent
restarts while the code is unchanged, and when it is missing or hung the agent starts
supervisors cold, saying so once."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections import Counter

import pytest

from tests.helpers import Node, poll_until
from tether.shared.procid import proc_stat


def wait_template(node: Node) -> int:
    return node.wait_template()


def supervisor_of(node: Node, job: int) -> int:
    return int(node.running_manifest(job)["supervisor"]["pid"])


def start_line(node: Node, pid: int) -> str:
    with open(node.layout.supervisor_log) as f:
        return next(ln for ln in f if f"supervisor[{pid}] " in ln and " ready on " in ln)


def fd_kinds(pid: int, base: str) -> tuple[Counter[str], set[str]]:
    """What a process's fds are (paths relative to the node's directory, or kinds: socket,
    pipe, anon_inode:...), and the set of its socket and pipe inodes."""
    kinds: Counter[str] = Counter()
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith(("socket:", "pipe:")):
            inodes.add(target)
            kinds[target.split(":")[0]] += 1
        elif target.startswith(base + "/"):
            kinds[target[len(base):]] += 1
        else:
            kinds[target] += 1
    return kinds, inodes


def agent_log(node: Node) -> str:
    with open(node.agent_logs[-1]) as f:
        return f.read()


def status_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def test_forked_supervisor_is_detached_and_inherits_nothing(make_node: object) -> None:
    warm: Node = make_node()  # type: ignore[operator]
    cold: Node = make_node(extra=[])  # type: ignore[operator]
    cold.env["TETHER_AGENT_FAULT"] = "no-template"
    warm.start()
    cold.start()
    template = wait_template(warm)
    assert cold.template_pids() == []
    assert status_of(template)["Threads"] == "1"  # nothing can hold a lock across the fork

    jobs = {n: n.submit("sleep", "60") for n in (warm, cold)}
    sups = {n: supervisor_of(n, j) for n, j in jobs.items()}
    assert "warm start" in start_line(warm, sups[warm])
    assert "cold start" in start_line(cold, sups[cold])

    w, c = sups[warm], sups[cold]
    wst, tst = proc_stat(w), proc_stat(template)
    assert wst is not None and tst is not None
    # detached: the template's child (os.fork), never the agent's, the leader of a session of
    # its own
    assert wst.ppid == template and tst.ppid != (warm.agent.pid if warm.agent else -1)
    assert wst.session == w != tst.session
    assert os.getsid(w) != os.getsid(warm.agent.pid if warm.agent else 0)

    # the same fds, threads and signal state as a supervisor started from scratch
    # (polled: a supervisor that just logged "running" may still hold its run dir's fd from
    # the manifest's directory fsync for a moment)
    def same_fds() -> bool:
        return fd_kinds(w, warm.dir)[0] == fd_kinds(c, cold.dir)[0]
    try:
        poll_until(same_fds, 10, "the warm and the cold supervisor to hold the same fds")
    except AssertionError:
        raise AssertionError(f"warm supervisor fds {fd_kinds(w, warm.dir)[0]} differ from a "
                             f"cold one's {fd_kinds(c, cold.dir)[0]}") from None
    winodes = fd_kinds(w, warm.dir)[1]
    _, tinodes = fd_kinds(template, warm.dir)
    assert not winodes & tinodes, "a supervisor shares a socket or pipe with the template"
    assert warm.agent is not None
    _, ainodes = fd_kinds(warm.agent.pid, warm.dir)
    assert not winodes & ainodes, "a supervisor shares a socket or pipe with the agent"
    ws, cs = status_of(w), status_of(c)
    for key in ("Threads", "SigBlk", "SigIgn", "SigCgt"):
        assert ws[key] == cs[key], f"{key}: warm {ws[key]} != cold {cs[key]}"
    # ZeroMQ's context is the supervisor's own, made after the fork: the template has pyzmq
    # loaded (libzmq mapped, nothing for a fork to copy again) but no context and no thread;
    # each supervisor has libzmq's two (I/O and reaper) beside its own
    with open(f"/proc/{template}/maps") as f:
        assert "libzmq" in f.read()
    assert status_of(template)["Threads"] == "1"
    for pid in (w, c):
        assert status_of(pid)["Threads"] == "3"

    # and its task sees only stdin, stdout and stderr
    task = warm.running_manifest(jobs[warm])["tasks"][0]["pid"]
    assert sorted(os.listdir(f"/proc/{task}/fd"), key=int) == ["0", "1", "2"]
    for n in (warm, cold):
        n.ok("cancel", str(jobs[n]))
        assert n.wait_end(jobs[n])["state"] == "cancelled"
    # the template never waits for its supervisors: the kernel reaps them (no zombie is left)
    poll_until(lambda: proc_stat(w) is None, 30, "the ended warm supervisor to be reaped")


def test_signals_the_agent_ignores_reach_neither_supervisors_nor_tasks(
        make_node: object) -> None:
    """Ignored dispositions survive exec: an agent started with some ignored would hand them
    to the template, and on to every supervisor and task. The template resets them once, at
    its start (a warm supervisor does nothing about them); a cold one resets them itself."""
    warm: Node = make_node()  # type: ignore[operator]
    cold: Node = make_node(extra=[])  # type: ignore[operator]
    cold.env["TETHER_AGENT_FAULT"] = "no-template"
    ignored = (signal.SIGALRM, signal.SIGWINCH)
    saved = [signal.signal(sig, signal.SIG_IGN) for sig in ignored]
    try:
        warm.start()
        cold.start()
        wait_template(warm)
    finally:
        for sig, old in zip(ignored, saved, strict=True):
            signal.signal(sig, old)
    jobs = {n: n.submit("sleep", "60") for n in (warm, cold)}
    for n, job in jobs.items():
        sup = supervisor_of(n, job)
        task = n.running_manifest(job)["tasks"][0]["pid"]
        mask = int(status_of(sup)["SigIgn"], 16)
        assert not mask & sum(1 << (sig - 1) for sig in ignored), f"supervisor SigIgn {mask:x}"
        assert int(status_of(task)["SigIgn"], 16) == 0, status_of(task)["SigIgn"]
        n.ok("cancel", str(job))
        assert n.wait_end(job)["state"] == "cancelled"


def test_a_kept_template_gives_each_supervisor_the_environment_of_its_agent(
        node: Node) -> None:
    """The template outlives agents; a supervisor's environment is its agent's (here: the
    supervisor fault switches), whatever the template's own was: changed variables are set,
    variables the agent does not pass are removed, the others kept."""
    fault = "TETHER_SUPERVISOR_FAULT"

    def usr2_ends_a_supervisor() -> bool:
        job = node.submit("sleep", "60")
        sup = supervisor_of(node, job)
        assert "warm start" in start_line(node, sup)
        os.kill(sup, signal.SIGUSR2)

        def outcome() -> str | None:
            with open(node.layout.supervisor_log) as f:
                if any(f"supervisor[{sup}] " in ln and "received SIGUSR2: ignored" in ln
                       for ln in f):
                    return "ignored"
            return "lost" if node.job(job)["state"] == "lost" else None
        got = poll_until(outcome, 30, "the supervisor to log or die of SIGUSR2")
        if got == "ignored":
            node.ok("cancel", str(job))
            assert node.wait_end(job)["state"] == "cancelled"
        return got == "lost"

    node.start(env={fault: "error-on-usr2"})
    template = wait_template(node)
    for env, dies in (({fault: "hold-scan"}, False), ({}, False), ({fault: "error-on-usr2"}, True)):
        node.stop(signal.SIGKILL)
        node.start(env=env)
        assert node.template_pids() == [template]
        assert usr2_ends_a_supervisor() == dies, f"with {env}"


FORK_PROBE = r"""
import os, random, sys, ctypes, ctypes.util
from tether.supervisor import template
libc = ctypes.CDLL(ctypes.util.find_library("c"))
out = []
for _ in range(2):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        template.after_fork(keep=(w,), log_fd=2)
        os.write(w, f"{random.getrandbits(64)} {libc.rand()} {len(os.listdir('/proc/self/fd'))}"
                 .encode())
        os._exit(0)
    os.close(w)
    out.append(os.read(r, 200).decode())
    os.close(r)
    os.waitpid(pid, 0)
parent = f"{random.getrandbits(64)} {libc.rand()}"
print(" | ".join([parent, *out]))
"""


def test_forked_children_do_not_share_random_state() -> None:
    """``random`` and libc's ``rand()`` (libzmq's peer ids) are reseeded in every child; every
    fd but the ones kept is closed (one more is listed: the directory being read)."""
    res = subprocess.run([sys.executable, "-c", FORK_PROBE, "x"], capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    parent, first, second = (part.split() for part in res.stdout.strip().split(" | "))
    assert first[0] != second[0] != parent[0] and first[0] != parent[0]
    assert first[1] != second[1] != parent[1] and first[1] != parent[1]
    assert first[2] == second[2] == "5"  # 0, 1, 2, the kept pipe, the listing's own fd


def test_template_survives_agent_restarts_and_is_replaced_when_the_code_changes(
        node: Node) -> None:
    node.start()
    template = wait_template(node)
    node.stop(signal.SIGKILL)
    node.start()
    assert node.template_pids() == [template]
    job = node.submit("true")
    assert node.wait_end(job)["state"] == "completed"
    assert "warm start" in start_line(node, int(node.job(job)["supervisor_pid"]))

    # a changed source file is other code: the next agent replaces the template
    src = os.path.join(os.path.dirname(__file__), "..", "..", "supervisor", "template.py")
    st = os.stat(src)
    node.stop()
    try:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        node.start()
        poll_until(lambda: proc_stat(template) is None or proc_stat(template).dead, 20,
                   "the outdated template to leave")
    finally:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    wait_template(node)


@pytest.mark.parametrize("breakage", ["killed", "hung"])
def test_without_a_working_template_supervisors_start_cold(node: Node, breakage: str) -> None:
    node.start()
    template = wait_template(node)
    if breakage == "killed":
        os.kill(template, signal.SIGKILL)
    else:
        os.kill(template, signal.SIGSTOP)  # accepts connections, never answers
    try:
        jobs = [node.submit("sh", "-c", f"exit {i}") for i in range(3)]
        for i, job in enumerate(jobs):
            end = node.wait_end(job)
            assert (end["state"], end["exit_code"]) == (("completed", 0) if i == 0 else
                                                        ("failed", i)), end
    finally:
        if breakage == "hung":
            with contextlib.suppress(ProcessLookupError):  # the agent should have killed it
                os.kill(template, signal.SIGCONT)
    log = agent_log(node)
    # the log is the contract here: said once, not once per cold start
    assert log.count("supervisor template unavailable") == 1, log
    if breakage == "hung":
        poll_until(lambda: proc_stat(template) is None or proc_stat(template).dead, 10,
                   "the hung template to be killed")
    first = int(node.job(jobs[0])["supervisor_pid"])
    assert "cold start" in start_line(node, first)

    # a new template is started, and supervisors start warm again
    def warm_again() -> bool:
        job = node.submit("true")
        node.wait_end(job)
        return "warm start" in start_line(node, int(node.job(job)["supervisor_pid"]))
    poll_until(warm_again, 30, "a supervisor started from a new template", interval=0.5)


def test_status_is_answered_while_fifty_steps_start(make_node: object) -> None:
    """The agent's loop never waits for a spawn: ``status`` is answered between them."""
    from tether.shared.client import Client

    node: Node = make_node(cpus=64)  # type: ignore[operator]
    node.start()
    wait_template(node)
    seen: list[dict[str, int]] = []
    with Client(node.layout.sock, timeout=20) as client:
        ids = []
        for _ in range(50):  # a status after every submit, while the earlier ones start
            ids.append(client.call("submit", {"command": ["sleep", "60"], "workdir": node.work,
                                              "env": {}})["id"])
            seen.append(client.call("status")["jobs"])

        def all_running() -> bool:
            seen.append(client.call("status")["jobs"])
            return seen[-1].get("running", 0) == 50
        poll_until(all_running, 120, "all 50 jobs to run", interval=0.005)
    # answered while steps were still starting, not only before or after all of them
    assert any(0 < c.get("running", 0) < 50 for c in seen), seen
    with Client(node.layout.sock, timeout=20) as client:
        for job in ids:
            client.call("cancel", {"job": job})
    poll_until(lambda: node.status()["jobs"].get("cancelled") == 50, 60, "all 50 cancelled")


def test_the_template_and_its_supervisors_map_no_compression_or_crypto_library(
        node: Node) -> None:
    """Every shared object the template maps, each fork copies the mappings of and each exit
    tears down: shutil (argparse's help formatter asks it for the terminal's width) brings
    bz2 and lzma with their libraries, hashlib OpenSSL's libcrypto; none is a supervisor's."""
    node.start()
    template = wait_template(node)
    job = node.submit("sleep", "60")
    sup = supervisor_of(node, job)
    for pid in (template, sup):
        with open(f"/proc/{pid}/maps") as f:
            libs = {os.path.basename(ln.split()[-1]) for ln in f if ".so" in ln}
        assert not [n for n in libs if any(w in n for w in ("bz2", "lzma", "crypto", "hashlib"))], (
            pid, sorted(libs))
    node.ok("cancel", str(job))
    assert node.wait_end(job)["state"] == "cancelled"


#: what the code may not use (issue 26): CPython's private API, by ctypes or in C (``_Py``
#: names, ``sys._`` functions, ``ctypes.pythonapi``, ``PyDLL``), and raw system calls through
#: ctypes (libc's ``syscall``) where the standard library has the call
PRIVATE = re.compile(r"\b_Py[A-Z]\w*|\bsys\._[a-z]\w*|\bpythonapi\b|\bPyDLL\b|\.syscall\b")


def test_no_cpython_private_api_and_no_raw_syscalls_anywhere_in_the_package() -> None:
    """A scan of every source file installed (Python and C): the template forks with
    ``os.fork`` and prepares its memory with public mechanisms only."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = []
    for top in ("tether", "shared", "supervisor", "agent", "cli"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                if not name.endswith((".py", ".c", ".h")):
                    continue
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    for n, line in enumerate(f, 1):
                        if PRIVATE.search(line.split("#", 1)[0] if name.endswith(".py")
                                          else line):
                            found.append(f"{os.path.relpath(path, root)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
