"""The output opener (supervisor/opener.py): a thread with a working directory and umask of its
own for a job of the supervisor's own user, a forked child for another user's job (and where the
kernel refuses the thread its own working directory). Both must open exactly alike: the same
files and modes, the same refusals, the same reasons."""

from __future__ import annotations

import os
import select
import stat
import subprocess
from typing import Any

import pytest

from tests.helpers import Node, poll_until
from tether.shared.procid import ProcId
from tether.supervisor.opener import Opened, ThreadOpener

#: the thread (the default for root's jobs here), and the fork it falls back to
WAYS: dict[str, dict[str, str]] = {
    "thread": {},
    "fork": {"TETHER_SUPERVISOR_FAULT": "refuse-unshare"},
}


def submit(node: Node, *command: str, opts: tuple[str, ...] = (), umask: int = 0o022) -> int:
    res = subprocess.run([*node.tether, "submit", *opts, "--", *command], capture_output=True,
                         text=True, env=node.env, cwd=node.work, timeout=60, umask=umask)
    assert res.returncode == 0, res.stderr
    return int(res.stdout)


@pytest.mark.parametrize("way", WAYS)
def test_both_ways_open_the_same_files_and_refuse_with_the_same_reasons(node: Node,
                                                                         way: str) -> None:
    node.start(env=WAYS[way])
    work = node.work
    out, err = os.path.join(work, "o.txt"), os.path.join(work, "e.txt")
    ok = submit(node, "sh", "-c", "echo out; echo err >&2; pwd",
                opts=("--output", out, "--error", err), umask=0o027)
    fifo = os.path.join(work, "fifo")
    os.mkfifo(fifo)
    piped = node.submit("echo", "x", opts=("--output", fifo))
    link = os.path.join(work, "link")
    target = os.path.join(node.dir, "target")
    os.symlink(target, link)
    linked = node.submit("echo", "x", opts=("--output", link))
    # a working directory removed while the job waits behind another
    blocker = node.submit("sleep", "30", opts=("--cpus", "4"))
    node.wait_state(blocker, ("running",))
    gone = os.path.join(node.dir, "gone")
    os.mkdir(gone)
    moved = node.submit("true", opts=("--workdir", gone, "--output", out + ".2",
                                      "--cpus", "4"))
    os.rmdir(gone)
    node.ok("cancel", str(blocker))

    j = node.wait_end(ok)
    assert (j["state"], j["exit_code"]) == ("completed", 0), j
    with open(out) as f:
        assert f.read() == f"out\n{work}\n"
    with open(err) as f:
        assert f.read() == "err\n"
    for path in (out, err):  # the submitter's umask, whoever opened them
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    reasons = {job: node.wait_end(job)["reason"] for job in (piped, linked, moved)}
    assert reasons == {
        piped: f"cannot open output file {fifo}: No such device or address",
        linked: f"cannot open output file {link}: Too many levels of symbolic links",
        moved: f"cannot enter working directory {gone}: No such file or directory",
    }
    assert not os.path.exists(target), "the opener followed a planted link"
    for job in (piped, linked, moved):
        assert (node.job(job)["state"], node.job(job)["exit_code"]) == ("failed", 127)
    with open(node.layout.supervisor_log) as f:  # thread or fork: no state tells, the log does
        forked = "forking one instead" in f.read()
    assert forked == (way == "fork")


def test_the_thread_leaves_the_supervisors_own_directory_and_umask_alone(node: Node) -> None:
    node.start()
    sub = os.path.join(node.work, "sub")
    os.mkdir(sub)
    job = submit(node, "sh", "-c", "pwd; umask; exec sleep 300",
                 opts=("--workdir", sub, "--output", "out.txt"), umask=0o077)
    man = node.running_manifest(job)
    sup = ProcId.from_dict(man["supervisor"]).pid
    poll_until(lambda: os.path.exists(os.path.join(sub, "out.txt")) and
               os.path.getsize(os.path.join(sub, "out.txt")) >= len(sub) + 6, 30, "the output")
    with open(os.path.join(sub, "out.txt")) as f:
        assert f.read() == f"{sub}\n0077\n"
    assert stat.S_IMODE(os.stat(os.path.join(sub, "out.txt")).st_mode) == 0o600
    assert os.readlink(f"/proc/{sup}/cwd") == "/"
    with open(f"/proc/{sup}/status") as f:
        umask = next(line.split()[1] for line in f if line.startswith("Umask:"))
    assert umask == "0022", "the opener thread's umask leaked into the supervisor"
    node.ok("cancel", str(job))
    node.wait_end(job)


def _spec(workdir: str, out: str, umask: int) -> dict[str, Any]:
    return {"workdir": workdir, "output": out, "error": out, "umask": umask, "ntasks": 1}


def _when_done(opener: ThreadOpener) -> None:
    r, _, _ = select.select([opener.fileno()], [], [], 10)
    assert r, "the opener thread did not finish"


def test_a_thread_opener_in_this_very_process(tmp_path: Any) -> None:
    """Its own working directory and umask: this process's stay as they were; a relative
    output path is the working directory's; what it opened is handed over once, or closed if
    it was given up on."""
    work = str(tmp_path)
    cwd, mask = os.getcwd(), os.umask(0o022)
    try:
        opener = ThreadOpener(_spec(work, "rel.txt", 0o077), ["rel.txt"])
        _when_done(opener)
        assert (os.getcwd(), os.umask(0o022)) == (cwd, 0o022)
        opened = opener.result()
        assert isinstance(opened, Opened)
        opener.close()
        os.write(opened.outputs["rel.txt"], b"hi\n")
        st = os.stat(os.path.join(work, "rel.txt"))
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert os.fstat(opened.outputs["rel.txt"]).st_ino == st.st_ino
        readers = [r for r in opened.readers if r is not None]
        assert len(readers) == 2 and os.pread(readers[0], 10, 0) == b"hi\n"
        opened.close()
        for r in readers:
            os.close(r)
        before = set(os.listdir("/proc/self/fd"))
        given_up = ThreadOpener(_spec(work, "other.txt", 0o022), ["other.txt"])
        _when_done(given_up)
        given_up.kill()
        given_up.close()
        assert set(os.listdir("/proc/self/fd")) == before, "a given-up opener's fds stayed open"
    finally:
        os.umask(mask)
