"""The run directories' parent is marked as the top of a directory hierarchy (ext2/3/4's
``chattr +T``), so that the file system spreads the run directories out (agent/statedir.py)."""

from __future__ import annotations

import array
import fcntl
import os
import tempfile

import pytest

from tests.helpers import Node
from tether.agent import statedir

_FS_IOC_GETFLAGS = 0x80086601


def _fs_type(path: str) -> str:
    """The type of the file system ``path`` is on (its longest mount point in /proc/mounts)."""
    real, best, kind = os.path.realpath(path), "", ""
    with open("/proc/mounts") as f:
        for line in f:
            mnt, typ = line.split()[1:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, typ
    return kind


def _flags(path: str) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        return flags[0]
    finally:
        os.close(fd)


ext = pytest.mark.skipif(_fs_type("/tmp") not in ("ext2", "ext3", "ext4"),
                         reason="/tmp is not on ext2/3/4")


@ext
def test_the_agent_marks_run_as_a_top_directory_and_jobs_run_under_it(node: Node) -> None:
    node.start()
    run = os.path.join(node.state, "run")
    assert _flags(run) & statedir.FS_TOPDIR_FL
    assert os.stat(run).st_mode & 0o777 == 0o755
    job = node.submit("sh", "-c", "echo spread")
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("completed", 0)
    assert _flags(run) & statedir.FS_TOPDIR_FL
    node.stop()
    node.start()  # an existing run/ keeps its mark and its other flags
    assert _flags(run) & statedir.FS_TOPDIR_FL


@ext
def test_make_run_root_keeps_the_other_flags() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.mkdir(os.path.join(d, "run"), 0o755)
            before = _flags(os.path.join(d, "run"))
            assert statedir.make_run_root(fd)
            assert _flags(os.path.join(d, "run")) == before | statedir.FS_TOPDIR_FL
            assert statedir.make_run_root(fd)  # again: nothing changes
            assert _flags(os.path.join(d, "run")) == before | statedir.FS_TOPDIR_FL
        finally:
            os.close(fd)


@pytest.mark.skipif(_fs_type("/dev/shm") != "tmpfs", reason="/dev/shm is not tmpfs")
def test_make_run_root_elsewhere_makes_a_plain_run_directory() -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert not statedir.make_run_root(fd)  # tmpfs has no such mark: no matter
            assert os.path.isdir(os.path.join(d, "run"))
            assert not statedir.make_run_root(fd)
        finally:
            os.close(fd)
