"""PID reuse: a dead supervisor's (or task's) pid now held by another process is never taken
for it, and that process is not killed as the step's leftover.

The kernel here ignores ns_last_pid, so the reuse is staged: after the supervisor is killed,
its recorded pid (in the manifest and the database) and its task's are pointed at two unrelated
live processes, with the original start ticks kept: exactly what a reused pid looks like.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess

from tests.helpers import Node, pid_alive, poll_until
from tether.shared.procid import ProcId


def test_a_reused_pid_is_not_the_supervisor_nor_its_task(node: Node) -> None:
    node.start()
    job = node.submit("sleep", "300")
    man = node.running_manifest(job)
    sup = ProcId.from_dict(man["supervisor"])
    task = man["tasks"][0]["pid"]
    node.stop(signal.SIGKILL)
    os.kill(sup.pid, signal.SIGKILL)
    poll_until(lambda: not sup.alive(), 10, "the supervisor to go")
    others = [subprocess.Popen(["sleep", "300"], start_new_session=True) for _ in range(2)]
    try:
        rd = node.layout.run_dir(job, 1)
        man["supervisor"]["pid"] = others[0].pid
        man["tasks"][0]["pid"] = others[1].pid
        with open(rd.manifest, "w") as f:
            json.dump(man, f)
        with sqlite3.connect(node.layout.db) as db:
            db.execute("UPDATE jobs SET supervisor_pid = ?, pids = ? WHERE id = ?",
                       (others[0].pid, json.dumps([others[1].pid]), job))
            db.execute("UPDATE job_facts SET supervisor_ticks = supervisor_ticks WHERE job = ?",
                       (job,))
        node.start()
        j = node.job(job)
        assert j["state"] == "lost", j
        poll_until(lambda: not pid_alive(task), 10, "the step's real task to be killed")
        assert [p.poll() for p in others] == [None, None], \
            "a process holding a recorded pid was killed\n" + node.logs()
        assert node.status()["cpus"]["allocated"] == 0
    finally:
        for p in others:
            p.kill()
            p.wait()
