"""What jobs and users name themselves is shown, never obeyed (issue 27, point 6): job names,
commands, process titles and user names with terminal escapes, markup and invisible reordering
characters, through `top` (plain snapshots), `list`, `show` and `inspect --pids`.

A user whose name is rich markup (``useradd --badname``) is created here and removed after."""

from __future__ import annotations

import os
import pwd
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.helpers import CLI, Node, poll_until
from tests.userkit import User, cli_as, home_for, remove_user, shared

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a user")

#: a window title, a bell, a screen clear, markup that ends a style never begun (rich raised
#: on it), an emoji code, and a right-to-left override
EVIL = "\x1b]0;pwned\x07[/x][bold]:fire:\x1b[2J\u202eevil"
#: what the terminal must show for it, in part
SHOWN = ("\\x1b]0;pwned\\x07[/x][bold]:fire:", "\\u202eevil")
RAW = ("\x1b", "\x07", "\u202e", "\U0001f525")  # the last: :fire: made an emoji


@contextmanager
def markup_user() -> Iterator[User]:
    """A user named ``tt[/x]`` and 4 hex characters (Debian's useradd takes it with
    ``--badname``), with a group of its own; always removed."""
    name = f"tt[/x]{secrets.token_hex(2)}"
    subprocess.run(["useradd", "--badname", "--no-create-home", "--user-group", "--shell",
                    "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        pw = pwd.getpwnam(name)
        yield User(name, pw.pw_uid, pw.pw_gid, pw.pw_dir)
    finally:
        remove_user(name)


def assert_shown_not_obeyed(out: str, *more: str) -> None:
    for raw in RAW:
        assert raw not in out, (raw, out)
    for part in (*SHOWN, *more):
        assert part in out, (part, out)


def test_hostile_names_commands_and_users_are_shown_escaped(node: Node) -> None:
    with markup_user() as mallory:
        shared(node)
        home = home_for(node, mallory, "mallory")
        node.start()
        # a process title of its own: a copy of sleep named with escapes (comm: its first 15
        # bytes; a file name, so no "/")
        script = 'cp /bin/sleep "./$2"; "./$2" 60 & touch started; wait'
        running = node.submit("sh", "-c", script, "sh", EVIL, "\x1b]0;pwned\x07",
                              opts=("--name", EVIL))
        res = cli_as(mallory, node, "submit", "--name", EVIL, "--", "sh", "-c", "sleep 60",
                     EVIL, cwd=home)
        assert res.returncode == 0, res.stderr
        hers = int(res.stdout)
        pending = node.submit("true", opts=("--hold", "--name", EVIL))
        ended = node.submit("true", EVIL, opts=("--name", EVIL))
        node.wait_end(ended)
        for job in (running, hers):
            node.wait_state(job, ("running",))
        poll_until(lambda: os.path.exists(os.path.join(node.work, "started")), 30,
                   "the renamed sleep to start")
        try:
            # top, as plain snapshots; wide enough that no column is cut
            top = subprocess.run([*CLI, "top", "--iterations", "1"], capture_output=True,
                                 text=True, env=dict(node.env, COLUMNS="400"), cwd=node.work,
                                 timeout=60)
            assert top.returncode == 0, top.stderr
            assert_shown_not_obeyed(top.stdout, mallory.name)
            assert top.stdout.count("[/x][bold]:fire:") == 4, top.stdout  # each table
            listed = node.ok("list", "--format", "id,user:30,name:80,state,command")
            assert_shown_not_obeyed(listed, mallory.name)
            for job in (running, hers, pending, ended):
                assert_shown_not_obeyed(node.ok("show", str(job)))
            pids = node.ok("inspect", str(running), "--pids")
            for raw in RAW:
                assert raw not in pids, pids
            assert "\\x1b]0;pwned\\x07" in pids, pids  # the renamed sleep's comm
        finally:
            node.ok("cancel", str(running), str(hers), str(pending))
            for job in (running, hers):
                node.wait_end(job)
