"""``tether top``: the live view in a real terminal (tmux) and as plain snapshots in a pipe
(issue 13, friction 9: no live view)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from tests.helpers import CLI, Node, poll_until


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node(cpus=2)
    try:
        n.start()
        yield n
    finally:
        n.cleanup()


@pytest.fixture(scope="module")
def busy(node: Node) -> Iterator[dict[str, int]]:
    burner = node.submit("sh", "-c", "while :; do :; done", opts=("--name", "burner"))
    node.wait_state(burner, ("running",))
    blocked = node.submit("sleep", "1", opts=("--cpus", "2", "--name", "blocked"))
    done = node.submit("true", opts=("--name", "finished"))
    try:
        yield {"burner": burner, "blocked": blocked, "done": done}
    finally:
        node.cli("cancel", "--state", "active")


def test_snapshots_in_a_pipe(node: Node, busy: dict[str, int]) -> None:
    res = node.cli("top", "--iterations", "2", "--interval", "0.3")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert out.count("tether top") == 2 and "\033" not in out
    assert "1/2 CPUs allocated" in out
    assert re.search(r"running \(1\)", out) and "burner" in out
    assert re.search(r"pending \(2\)", out) and "blocked" in out


@pytest.mark.parametrize("quit_key", ["q", "C-c"])
def test_live_view_in_a_terminal(node: Node, busy: dict[str, int], quit_key: str) -> None:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed (scripts/setup.sh --tests installs it)")
    d = tempfile.mkdtemp(dir="/tmp", prefix="tttop")
    sock = os.path.join(d, "tmux")
    tmux = ["tmux", "-S", sock, "-f", "/dev/null"]
    command = " ".join([*CLI, "top", "--interval", "0.2"])
    try:
        subprocess.run([*tmux, "new-session", "-d", "-x", "120", "-y", "45", "-e",
                        f"TETHER_STATE_DIR={node.state}", command], check=True, timeout=30)

        def screen() -> str:
            res = subprocess.run([*tmux, "capture-pane", "-p"], capture_output=True,
                                 text=True, timeout=30)
            return res.stdout

        def burner_row() -> str | None:
            for line in screen().splitlines():
                cells = [c.strip() for c in line.split("│")]
                if "burner" in cells and len(cells) > 6 and cells[5]:
                    return line  # the CPU% cell is filled from two samples
            return None

        row = poll_until(burner_row, 60, "top to show the busy job with its CPU use")
        cells = [c.strip() for c in row.split("│")]
        assert float(cells[5]) > 0, row
        assert "tether top" in screen() and "blocked" in screen()
        subprocess.run([*tmux, "send-keys", quit_key], check=True, timeout=30)
        poll_until(lambda: subprocess.run([*tmux, "has-session"], capture_output=True,
                                          timeout=30).returncode != 0, 30,
                   f"top to quit on {quit_key}")
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=30)
        shutil.rmtree(d)


def test_top_without_an_agent_keeps_trying() -> None:
    d = tempfile.mkdtemp(dir="/tmp", prefix="tttop")
    try:
        res = subprocess.run([*CLI, "--state-dir", d, "top", "--iterations", "1"],
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0
        assert "no agent is answering" in res.stdout and "trying again" in res.stdout
    finally:
        shutil.rmtree(d)
