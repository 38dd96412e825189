"""Damaged run directories: every kind gets a definite verdict at the agent's first start, and no
process of the step is left running (the database's identity leads to the step when the
manifest cannot). A forged exit record never makes a job run twice."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator

import pytest

from tests.helpers import Node, poll_until
from tether.shared.paths import RunDir
from tether.shared.procid import all_processes, proc_stat

#: a task with a child in a process group of its own (still in the step's session)
TASK = ["sh", "-c", "python3 -c 'import os, time; os.setpgid(0, 0); time.sleep(600)' & "
                    "exec sleep 600"]


def _write(path: str, data: bytes) -> None:
    tmp = path + ".new"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _edit_manifest(change: Callable[[dict[str, object]], None]) -> Callable[[RunDir], None]:
    def damage(rd: RunDir) -> None:
        with open(rd.manifest) as f:
            man = json.load(f)
        change(man)
        _write(rd.manifest, json.dumps(man).encode())
    return damage


def _sentinel(**fields: object) -> Callable[[RunDir], None]:
    def damage(rd: RunDir) -> None:
        rec = {"schema": 1, "job": rd.job, "attempt": rd.attempt, "state": "completed",
               "launched": True, "exit_code": 0, "signal": None, "reason": None, **fields}
        _write(rd.sentinel, json.dumps(rec).encode())
    return damage


def _truncate(rd: RunDir) -> None:
    with open(rd.manifest, "rb") as f:
        data = f.read()
    _write(rd.manifest, data[:len(data) // 2])


def _symlink(rd: RunDir) -> None:
    os.unlink(rd.manifest)
    os.symlink("/etc/passwd", rd.manifest)


DAMAGE: dict[str, Callable[[RunDir], None]] = {
    "manifest truncated": _truncate,
    "manifest empty": lambda rd: _write(rd.manifest, b""),
    "manifest garbage": lambda rd: _write(rd.manifest, b"\x00\xff not json"),
    "manifest a symlink": _symlink,
    "manifest oversized": lambda rd: _write(rd.manifest, b" " * (2 << 20)),
    "manifest nested 5000 deep": lambda rd: _write(rd.manifest, b"[" * 5000 + b"]" * 5000),
    "manifest unknown phase": _edit_manifest(lambda m: m.update(phase="exploding")),
    "manifest wrong types": _edit_manifest(lambda m: m.update(session="x", tasks={})),
    "manifest removed": lambda rd: os.unlink(rd.manifest),
    "manifest bogus pid": _edit_manifest(
        lambda m: m.update(supervisor={"boot_id": "x", "pid": 4_000_000, "start_ticks": 1})),
    "manifest huge session": _edit_manifest(lambda m: m.update(session=1 << 64)),
    "exit record nested 5000 deep": lambda rd: _write(rd.sentinel, b"{\"a\":" * 5000),
    "exit record reason a list": _sentinel(reason=["a", "b"]),
    "exit record reason a map": _sentinel(reason={"a": 1}),
    "exit record exit_code 2^63": _sentinel(state="failed", exit_code=1 << 63),
    "exit record signal 2^63": _sentinel(state="failed", exit_code=None, signal=1 << 63),
    "exit record forged: aborted yet launched": _sentinel(state="aborted", launched=True,
                                                          exit_code=None),
}


@pytest.fixture
def big_node() -> Iterator[Node]:
    n = Node(cpus=len(DAMAGE) + 2)
    try:
        yield n
    finally:
        n.cleanup()


def _session_alive(session: int) -> list[int]:
    return [st.pid for st in all_processes() if st.session == session and not st.dead]


def test_every_damaged_record_gets_a_verdict_at_first_start_and_leaves_no_process(
        big_node: Node) -> None:
    node = big_node
    node.start()
    jobs = {kind: node.submit(*TASK) for kind in DAMAGE}
    sessions: dict[str, int] = {}
    sups: list[int] = []
    for kind, job in jobs.items():
        man = node.running_manifest(job)
        sessions[kind] = man["session"]
        sups.append(man["supervisor"]["pid"])
        # the supervisor, the task (sleep) and its python child in a group of its own
        poll_until(lambda s=man["session"]: len(_session_alive(s)) >= 3, 30,
                   f"job {job}'s processes")
    node.stop(signal.SIGKILL)
    for pid in sups:
        os.kill(pid, signal.SIGKILL)
    poll_until(lambda: all(proc_stat(p) is None or proc_stat(p).dead for p in sups), 10,
               "the supervisors to die")
    for kind, job in jobs.items():
        DAMAGE[kind](node.layout.run_dir(job, 1))

    node.start()
    problems = []
    for kind, job in jobs.items():
        j = node.job(job)  # reattach is over before the agent answers: no polling
        if j["state"] != "lost" or j["attempt"] != 1:
            problems.append(f"{kind}: {j['state']} attempt {j['attempt']} ({j['reason']})")
        elif "(pid 4000000)" in (j["reason"] or ""):
            problems.append(f"{kind}: the reason blames the forged pid: {j['reason']}")
    assert not problems, "\n".join(problems) + "\n" + node.logs()
    for kind, session in sessions.items():
        poll_until(lambda s=session: not _session_alive(s), 10,
                   f"every process of the step with a {kind} to be killed "
                   f"(left: {_session_alive(session)})\n{node.logs()}")
    assert node.status()["cpus"]["allocated"] == 0
    assert not node.supervisor_pids(), "a job ran again"
