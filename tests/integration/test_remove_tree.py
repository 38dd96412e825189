"""The supervisor's removal of its run directory (service.remove_tree): everything in it goes,
sockets and ``ctl/`` included, and nothing a symlink in it points to."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile

from tether.supervisor.service import remove_tree


def test_the_run_directory_goes_and_what_its_symlinks_name_stays() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="rt") as root:
        outside = os.path.join(root, "outside")
        os.makedirs(os.path.join(outside, "deep"))
        with open(os.path.join(outside, "deep", "precious"), "w") as f:
            f.write("keep me")
        run = os.path.join(root, "run", "7.1")
        os.makedirs(os.path.join(run, "ctl"))
        for name in ("lock", "spec.json", "manifest.json", ".exit.json.12.tmp"):
            open(os.path.join(run, name), "w").close()
        with socket.socket(socket.AF_UNIX) as s1, socket.socket(socket.AF_UNIX) as s2:
            s1.bind(os.path.join(run, "sock"))
            s2.bind(os.path.join(run, "ctl", "sock"))
        os.symlink(outside, os.path.join(run, "ctl", "escape"))
        os.symlink(os.path.join(outside, "deep", "precious"), os.path.join(run, "link"))
        remove_tree(run)
        assert not os.path.lexists(run)
        with open(os.path.join(outside, "deep", "precious")) as f:
            assert f.read() == "keep me"
        remove_tree(run)  # gone already: nothing to do, no error
        os.symlink(outside, run)  # the path itself a symlink: not followed, not removed
        remove_tree(run)
        assert os.path.islink(run) and os.path.exists(os.path.join(outside, "deep", "precious"))


EMFILE_PROBE = """
import os, resource, sys
from tether.supervisor.service import remove_tree
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
os.close(held.pop())  # room for the run directory's fd, none for scandir's own (a dup)
remove_tree(sys.argv[1])
print("returned")
"""


def test_errors_are_ignored_at_the_top_too() -> None:
    """Out of fds at the supervisor's exit: the run directory stays (the agent removes it),
    and ``remove_tree`` returns as ``shutil.rmtree(ignore_errors=True)`` did, not raising out
    of the supervisor's last ``finally``."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="rt") as root:
        run = os.path.join(root, "7.1")
        os.makedirs(os.path.join(run, "ctl"))
        open(os.path.join(run, "lock"), "w").close()
        res = subprocess.run([sys.executable, "-I", "-c", EMFILE_PROBE, run],
                             capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
        assert (res.returncode, res.stdout) == (0, "returned\n"), res.stderr
