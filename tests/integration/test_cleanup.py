"""Processes a task leaves behind are killed when its job ends: daemons, background children."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator

import pytest

from tests.helpers import Node, poll_until
from tether.shared.procid import ProcId, proc_stat

#: The task exits (0) only once the test has seen its leftover alive and created ``go``.
HOLD = "while [ ! -e go ]; do sleep 0.05; done; exit 0"


@pytest.fixture
def started(node: Node) -> Iterator[Node]:
    node.start()
    yield node


class Leftover:
    """A pid a task wrote to a file, pinned to its start time so pid reuse can't fool us."""

    def __init__(self, node: Node, name: str) -> None:
        path = os.path.join(node.work, name)

        def read() -> int | None:
            try:
                with open(path) as f:
                    text = f.read()
            except FileNotFoundError:
                return None
            return int(text) if text.endswith("\n") else None
        pid = poll_until(read, 20, f"{name} to be written\n{node.logs()}")
        ident = ProcId.of(pid)
        assert ident is not None, f"process {pid} from {name} is already gone"
        self.ident = ident

    def alive(self) -> bool:
        return self.ident.alive()

    def kill(self) -> None:
        """Test cleanup only: the node fixture can't find a process that left the session."""
        if self.ident.alive():
            os.kill(self.ident.pid, signal.SIGKILL)


def _gone_after_end(node: Node, job: int, leftover: Leftover) -> None:
    try:
        assert leftover.alive()
        open(os.path.join(node.work, "go"), "w").close()  # let the task exit now
        end = node.wait_end(job, timeout=30)
        assert end["state"] == "completed", end
        assert end["exit_code"] == 0, end
        poll_until(lambda: not leftover.alive(), 15,
                   f"leftover pid {leftover.ident.pid} of job {job} to be killed\n{node.logs()}")
    finally:
        leftover.kill()


def test_daemonized_grandchild_is_killed(started: Node) -> None:
    node = started
    job = node.submit("sh", "-c",
                      "(setsid sh -c 'echo $$ > gc.pid; exec sleep 300' &); " + HOLD)
    gc = Leftover(node, "gc.pid")
    st = proc_stat(gc.ident.pid)
    assert st is not None and st.session == gc.ident.pid, "it should lead a session of its own"
    _gone_after_end(node, job, gc)


def test_background_child_in_the_task_group_is_killed(started: Node) -> None:
    node = started
    job = node.submit("sh", "-c", "sleep 300 & echo $! > bg.pid; " + HOLD)
    bg = Leftover(node, "bg.pid")
    _gone_after_end(node, job, bg)


def test_background_child_in_a_group_of_its_own_is_killed(started: Node) -> None:
    node = started
    # the background child leads a new process group of its own (setpgid), still our child
    script = ("import os, subprocess, time\n"
              "p = subprocess.Popen(['sleep', '300'], process_group=0)\n"
              "with open('bg.pid', 'w') as f: f.write(f'{p.pid}\\n')\n"
              "while not os.path.exists('go'): time.sleep(0.05)\n"
              "os._exit(0)\n")
    job = node.submit(sys.executable, "-c", script)
    bg = Leftover(node, "bg.pid")
    st = proc_stat(bg.ident.pid)
    assert st is not None and st.pgrp == bg.ident.pid, "the child should lead its own group"
    _gone_after_end(node, job, bg)


def test_node_cleanup_kills_a_template_that_has_no_title_yet() -> None:
    """The test harness itself (a leak found in a full run): a template still importing (its
    command line not yet its title) binds its socket while cleanup removes the state dir; it
    must not survive the cleanup, nor the directory. Staged with a stand-in that has the
    template's command line and binds late."""
    import subprocess

    node = Node()
    sock = os.path.join(node.state, "template.sock")
    os.makedirs(node.state)
    late = subprocess.Popen(
        [sys.executable, "-I", "-c",
         "import os, socket, sys, time\n"
         "while not os.path.exists(sys.argv[3] + '.go'): time.sleep(0.01)\n"
         "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[3]); time.sleep(120)",
         "-m", "--socket", sock], start_new_session=True)
    try:
        open(sock + ".go", "w").close()  # it binds as the cleanup runs
        node.cleanup()
        assert late.wait(timeout=10) == -signal.SIGKILL, "the stand-in template survived"
        assert not os.path.exists(node.dir), os.listdir(node.dir)
    finally:
        if late.poll() is None:
            late.kill()
        late.wait()
