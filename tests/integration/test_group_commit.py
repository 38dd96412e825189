"""Group commit: the agent makes each turn's writes durable with one sync and tells nobody
anything of that turn before it (agent/group_commit.py ``hold`` and ``flush``, agent/db.py
``sync``).

The fault ``crash-before-sync[:N]`` SIGKILLs the agent at its Nth sync that has replies or
other actions held: after the turn's commits, before the fsync and before anything held went
out. Whatever a client was told before that must be there after a restart."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading

from tests.helpers import Node, poll_until
from tether.shared.client import Client
from tether.shared.errors import TetherError


def _submit(client: Client, node: Node, *command: str) -> int:
    res = client.call("submit", {"command": list(command), "workdir": node.work,
                                 "umask": 0o022})
    return int(res["id"])


def _listed(node: Node) -> dict[int, list[str]]:
    with Client(node.layout.sock) as c:
        jobs = c.call("list", {})["jobs"]
    return {int(j["id"]): j["command"] for j in jobs}


def _submit_under_fault(node: Node, fault: str) -> list[object]:
    """Start the agent with ``fault`` and submit once: [the reply] or [the error it met]."""
    node.start(env={"TETHER_AGENT_FAULT": fault})
    got: list[object] = []
    with Client(node.layout.sock, timeout=20) as c:
        try:
            got.append(_submit(c, node, "true"))
        except TetherError as exc:
            got.append(exc)
    return got


def test_a_submit_is_not_answered_before_its_sync(node: Node) -> None:
    """SIGKILLed between the submit's commit and the sync: the submitter heard nothing (a
    reply sent before the sync would have reached it: the agent replies, then syncs)."""
    got = _submit_under_fault(node, "crash-before-sync")
    assert node.agent is not None
    assert node.agent.wait(timeout=20) == -signal.SIGKILL, node.logs()
    assert len(got) == 1 and isinstance(got[0], TetherError), \
        f"the submit was answered before its commit was synced: {got}"
    node.start()
    # crash window 1 (docs/architecture.md, section 7): no job, or one whole job
    jobs = list(_listed(node).values())
    assert jobs in ([], [["true"]]), f"a half-made job: {jobs}"


def test_concurrent_submits_crash_before_a_sync_lose_nothing_acknowledged(
        make_node: type[Node]) -> None:
    """Eight clients submit at once; the agent is SIGKILLed before its 12th sync with
    something held. Every id a client was given is distinct and, after a restart, recorded
    with that client's command; nothing was given twice."""
    node = make_node(cpus=1)
    node.start(env={"TETHER_AGENT_FAULT": "crash-before-sync:12"})
    assert node.agent is not None
    acked: dict[int, list[str]] = {}
    refused = [0]
    lock = threading.Lock()

    def client(n: int) -> None:
        with Client(node.layout.sock, timeout=20) as c:
            for k in range(20):
                command = ["sh", "-c", "sleep 600", f"c{n}k{k}"]
                try:
                    job_id = _submit(c, node, *command)
                except TetherError:  # the agent died: no answer, no promise
                    with lock:
                        refused[0] += 1
                    return
                with lock:
                    assert job_id not in acked, f"id {job_id} given twice"
                    acked[job_id] = command

    threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert node.agent.wait(timeout=20) == -signal.SIGKILL, node.logs()
    assert acked, "no submit was answered before the crash"
    assert refused[0] >= 1, "the agent never crashed while clients were submitting"
    node.start()
    recorded = _listed(node)
    for job_id, command in acked.items():
        assert recorded.get(job_id) == command, \
            f"job {job_id} was acknowledged but not recorded as submitted: {recorded.get(job_id)}"


def test_many_concurrent_submits_get_distinct_durable_ids(node: Node) -> None:
    """A burst of concurrent submits (several per turn of the agent's loop, one commit each
    and one sync for all): distinct ids, each recorded with its own command, all still there
    after the agent is SIGKILLed and restarted."""
    node.start()
    assert node.agent is not None
    acked: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(10)

    def client(n: int) -> None:
        try:
            with Client(node.layout.sock, timeout=30) as c:
                barrier.wait(10)
                for k in range(10):
                    command = ["true", f"c{n}", f"k{k}"]
                    job_id = _submit(c, node, *command)
                    with lock:
                        assert job_id not in acked, f"id {job_id} given twice"
                        acked[job_id] = command
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    assert len(acked) == 100
    assert sorted(acked) == list(range(1, 101)), "ids are not dense"
    node.stop(signal.SIGKILL)
    node.start()
    recorded = _listed(node)
    assert {j: recorded.get(j) for j in acked} == acked
    poll_until(lambda: node.status()["jobs"]["completed"] == 100, 120,
               "the 100 jobs to complete")
    assert os.path.isdir(node.work)


def test_a_slow_spawn_holds_up_no_request(node: Node) -> None:
    """The file system work of a spawn (run directory, spec) is done off the agent's loop:
    while it is stuck (fault ``hold-spawn-prep``), ``status`` answers, submits are
    acknowledged and a pending job is cancelled; once it goes on, the job runs."""
    node.start(env={"TETHER_AGENT_FAULT": "hold-spawn-prep"})
    held = os.path.join(node.state, "prep.held")
    first = node.submit("true")
    poll_until(lambda: os.path.exists(held), 20, "the first spawn's preparation to be held")
    assert node.job(first)["state"] == "starting"
    with Client(node.layout.sock, timeout=5) as c:
        c.call("status")
        second = _submit(c, node, "true")
        third = _submit(c, node, "sleep", "600")
    assert node.status()["jobs"]["starting"] >= 1
    node.ok("cancel", str(third))
    with open(os.path.join(node.state, "prep.go"), "w"):
        pass
    assert node.wait_end(first)["state"] == "completed"
    assert node.wait_end(second)["state"] == "completed"
    assert node.job(third)["state"] == "cancelled"


def test_the_loop_records_requests_while_an_fsync_is_slow(make_node: type[Node]) -> None:
    """While the sync thread is stuck before an fsync (fault ``hold-sync``), the loop goes on
    reading and recording submits (committed, not yet answered); once the fsync goes on, every
    submitter is answered, and the submits that came in meanwhile shared the fsyncs that
    followed (fewer fsyncs than submits)."""
    node = make_node(cpus=1)
    node.start(env={"TETHER_AGENT_FAULT": "hold-sync"})
    acked: list[int] = []
    lock = threading.Lock()

    def client(*command: str) -> None:
        with Client(node.layout.sock, timeout=60) as c:
            job_id = _submit(c, node, *command)
            with lock:
                acked.append(job_id)

    # the first submit's fsync is held (its reply waits too); it takes the only CPU
    threads = [threading.Thread(target=client, args=("sleep", "600"))]
    threads[0].start()
    held = os.path.join(node.state, "sync.held")
    poll_until(lambda: os.path.exists(held), 20, "a sync to be held")
    threads += [threading.Thread(target=client, args=("true", f"c{n}")) for n in range(8)]
    for t in threads[1:]:
        t.start()

    def recorded() -> int:
        db = sqlite3.connect(f"file:{node.layout.db}?mode=ro", uri=True)
        try:
            return int(db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])
        finally:
            db.close()
    poll_until(lambda: recorded() == 9, 30, "the loop to record every submit meanwhile")
    assert acked == [], "a submit was answered before its fsync"
    with open(os.path.join(node.state, "sync.go"), "w"):
        pass
    for t in threads:
        t.join(60)
    assert sorted(acked) == list(range(1, 10))
    syncs = node.status()["db_syncs"]
    assert syncs < 1 + 1 + 8, f"{syncs} fsyncs: the submits did not share them"


def test_an_fsync_that_fails_stops_the_agent_and_answers_nothing(node: Node) -> None:
    """An fsync of the database fails (fault ``fail-sync``: EIO, as a dying disk): the agent
    exits with an error naming it, and the submit that waited for it got no answer; a
    restarted agent serves from what the database holds."""
    got = _submit_under_fault(node, "fail-sync")
    assert node.agent is not None
    assert node.agent.wait(timeout=20) == 1, node.logs()
    assert "cannot make the database durable" in node.logs()  # its one-line error is the contract
    assert len(got) == 1 and isinstance(got[0], TetherError), got
    node.start()
    assert node.status()["db_syncs"] >= 1
