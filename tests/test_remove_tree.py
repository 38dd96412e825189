"""The supervisor's removal of its run directory (service.remove_tree): everything in it goes,
sockets and ``ctl/`` included, and nothing a symlink in it points to."""

from __future__ import annotations

import os
import socket
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
