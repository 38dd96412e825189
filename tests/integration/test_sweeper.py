"""Finding the supervisor's leftover children (supervisor/sweeper.py): from its threads'
``/proc/PID/task/TID/children`` files on the loop, or by a scan of all of /proc on a thread
(kernels without those files; the ``proc-scan`` fault). Both find the same children, zombies
told apart, and a step ends only once its double-forked daemons (and what they left) are gone."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading

import pytest

from tests.helpers import Node, pid_alive, poll_until
from tether.shared.procid import children
from tether.supervisor.sweeper import Found, Sweeper, children_files, scan_children

pytestmark = pytest.mark.skipif(not children_files(),
                                reason="this kernel has no /proc/PID/task/TID/children")


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "300"])


def test_the_children_files_list_what_a_scan_of_proc_finds() -> None:
    me = os.getpid()
    procs = [_sleeper() for _ in range(3)]
    zombie = subprocess.Popen(["true"])
    # one forked by another thread: it belongs to that thread, whose file is read too
    from_thread: list[subprocess.Popen[bytes]] = []
    done = threading.Event()

    def fork_and_wait() -> None:
        from_thread.append(_sleeper())
        done.wait(30)
    th = threading.Thread(target=fork_and_wait)
    th.start()
    try:
        poll_until(lambda: from_thread, 10, "the thread's child")
        poll_until(lambda: os.waitid(os.P_PID, zombie.pid,
                                     os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None,
                   10, "`true` to exit")
        ours = {p.pid for p in [*procs, zombie, *from_thread]}
        listed = children(me)
        assert listed is not None and ours <= set(listed)
        assert set(listed) == {f.pid for f in scan_children(me)}
        sweeper = Sweeper()
        assert sweeper.inline
        sweeper.start()
        assert sweeper.busy
        found = {f.pid: f.dead for f in sweeper.result()}
        assert {pid: found.get(pid) for pid in ours} == {
            **{p.pid: False for p in [*procs, *from_thread]}, zombie.pid: True}
        sweeper.close()
    finally:
        done.set()
        th.join()
        for p in [*procs, *from_thread]:
            p.kill()
        for p in [*procs, *from_thread, zombie]:
            p.wait()


@pytest.mark.parametrize("inline", [True, False])
def test_what_was_reaped_after_the_look_is_never_handed_back(inline: bool) -> None:
    procs = [_sleeper() for _ in range(2)]
    try:
        sweeper = Sweeper(inline=inline)
        sweeper.start()
        procs[0].kill()
        procs[0].wait()  # reaped between the look and its result, as the loop would
        sweeper.note_reaped(procs[0].pid)
        assert select.select([sweeper.fileno()], [], [], 10)[0], "no result came"
        got = sweeper.result()
        assert procs[0].pid not in {f.pid for f in got}
        assert Found(procs[1].pid, False) in got
        assert sweeper.again, "a reap during the look must ask for another"
        sweeper.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()


#: A task that leaves a daemon in a session of its own, which itself leaves a child in another
#: session: that child is re-parented to the supervisor only once the daemon is killed. Both
#: write their pids; the task exits once they have.
DAEMONS = ("setsid sh -c 'setsid sh -c \"echo \\$\\$ > inner.pid; exec sleep 300\" "
           "</dev/null >/dev/null 2>&1 & echo $$ > outer.pid; exec sleep 300' "
           "</dev/null >/dev/null 2>&1 & "
           "while [ ! -s outer.pid ] || [ ! -s inner.pid ]; do sleep 0.01; done")


@pytest.mark.parametrize("fault", ["", "proc-scan"])
def test_a_double_forked_daemon_and_its_own_child_die_with_the_step(node: Node,
                                                                     fault: str) -> None:
    # Without cgroups (a step's cgroup would kill both before any look for leftovers).
    node.args += ["--cgroup", "none"]
    node.start(env={"TETHER_SUPERVISOR_FAULT": fault} if fault else None)
    job = node.submit("sh", "-c", DAEMONS)
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0), j
    pids = []
    for name in ("outer.pid", "inner.pid"):
        with open(os.path.join(node.work, name)) as f:
            pids.append(int(f.read()))
    try:
        # the exit record is written only once no child is left: both are gone already
        assert [p for p in pids if pid_alive(p)] == [], "a leftover outlived its step"
        with open(node.layout.supervisor_log) as f:
            log = f.read()
        assert log.count("killed leftover process") >= 2, log  # by the sweeper: only logged
    finally:
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
