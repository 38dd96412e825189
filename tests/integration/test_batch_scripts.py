"""Batch scripts as Slurm users write them (issue 28, point 1): ``tether submit job.sh [ARG...]``
without ``--`` keeps a copy of the script in the job's record, and the copy is what runs (an
edit after submit changes nothing), as the user, read from a file descriptor (never a path of
hers the agent opens, never executed by root); ``#TETHER`` and ``#SBATCH`` lines give options
before the command line's, which win; the ``#SBATCH`` options tether lacks are named in one
warning; a script that is not executable runs by its ``#!`` interpreter, or /bin/sh."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
from collections.abc import Iterator

import pytest

from tests.helpers import CLI, Node, poll_until
from tests.userkit import User, home_for, made_users, ok_as, shared
from tether.shared import batch
from tether.shared.errors import TetherError

USAGE = 2


def write(path: str, text: str, mode: int = 0o644) -> str:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return path


def output(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_a_script_edited_after_submit_runs_as_submitted_with_its_directives(node: Node) -> None:
    node.start()
    script = write(os.path.join(node.work, "job.sh"), (
        "#!/bin/sh\n"
        "#SBATCH --ntasks 2\n"
        "#SBATCH -p debug --mail-type=END\n"
        "#SBATCH --job-name=from-sbatch  # a comment\n"
        "\n"
        "#TETHER --output out-%j.%t\n"
        "# an ordinary comment\n"
        'echo "rank $TETHER_TASK_ID of $TETHER_NTASKS: $# args: $1|$2 ($0)"\n'
        "#SBATCH --ntasks 5\n"  # after the first command: not a directive (Slurm's rule)
        'echo "dir $TETHER_SUBMIT_DIR"\n'))
    res = node.cli("submit", "--hold", "job.sh", "one", "two words")  # not executable, no --
    assert res.returncode == 0, res.stderr
    job = int(res.stdout)
    # one warning, naming every #SBATCH option tether does not have
    assert res.stderr == ("tether: job.sh: ignoring #SBATCH -p, --mail-type: not options "
                          "tether has (docs/slurm.md)\n")
    write(script, "#!/bin/sh\necho edited; exit 3\n")  # the file changes; the job does not
    os.chmod(script, 0)
    node.ok("release", str(job))
    j = node.wait_end(job)
    assert (j["state"], j["ntasks"], j["name"]) == ("completed", 2, "from-sbatch"), j
    assert j["command"] == [script, "one", "two words"]
    for rank in (0, 1):
        text = output(os.path.join(node.work, f"out-{job}.{rank}"))
        first, second = text.splitlines()
        assert first.startswith(f"rank {rank} of 2: 2 args: one|two words (/proc/self/fd/")
        assert second == f"dir {node.work}"


def test_command_line_options_win_over_the_script_s(node: Node) -> None:
    node.start()
    write(os.path.join(node.work, "job.sh"), (
        "#!/bin/bash\n#SBATCH -n 3\n#SBATCH --job-name=script-name\n#TETHER --time 5\n"
        "#SBATCH --output=script.out\necho ran\n"))
    job = int(node.ok("submit", "-n", "1", "-J", "cli-name", "job.sh").strip())
    j = node.wait_end(job)
    assert (j["ntasks"], j["name"], j["time_limit"], j["state"]) == (1, "cli-name", 300,
                                                                      "completed")
    assert output(os.path.join(node.work, "script.out")) == "ran\n"
    # and an --env of the command line goes on top of the script's
    write(os.path.join(node.work, "env.sh"),
          '#TETHER --env A=script --env B=script -o env.out\necho "$A $B"\n')
    job = int(node.ok("submit", "--env", "B=cli", "env.sh").strip())
    assert node.wait_end(job)["state"] == "completed"
    assert output(os.path.join(node.work, "env.out")) == "script cli\n"


@pytest.mark.parametrize("first_line, want", [
    ("", "sh"),  # no #! at all: /bin/sh
    ("#!/bin/sh -e\n", "sh"),  # an argument: one word, as the kernel passes it
    ("#!/usr/bin/env python3\n", "python"),
])
def test_a_script_runs_by_its_interpreter_whatever_its_mode(node: Node, first_line: str,
                                                            want: str) -> None:
    node.start()
    body = ("import os; print('python', os.getuid())\n" if "python" in first_line
            else 'echo sh "$(id -u)"; false; echo "not stopped by -e"\n')
    write(os.path.join(node.work, "s"), first_line + "#TETHER -o s.out\n" + body, 0o600)
    job = int(node.ok("submit", "s").strip())
    j = node.wait_end(job)
    text = output(os.path.join(node.work, "s.out"))
    assert text.split()[:2] == [want, "0"], text
    if first_line == "#!/bin/sh -e\n":  # -e reached the shell: `false` ended the script
        assert (j["state"], j["exit_code"]) == ("failed", 1)
    else:
        assert j["state"] == "completed"


def test_programs_and_double_dashes_run_as_commands_as_before(node: Node) -> None:
    node.start()
    # an ELF executable named without --: a command, not a script to copy
    job = int(node.ok("submit", "/bin/true").strip())
    assert node.wait_end(job)["state"] == "completed"
    # after --, an executable script runs from its own path, as given, and nothing is read
    path = write(os.path.join(node.work, "x.sh"), '#!/bin/sh\n#TETHER --name nope\necho "$0"\n',
                 0o755)
    job = int(node.ok("submit", "-o", "x.out", "--", "./x.sh").strip())
    j = node.wait_end(job)
    assert (j["state"], j["name"]) == ("completed", "x.sh")
    assert output(os.path.join(node.work, "x.out")) == "./x.sh\n"
    # a word that names no file is a command from PATH, as it always was
    job = int(node.ok("submit", "-o", "e.out", "echo", "hi").strip())
    assert node.wait_end(job)["state"] == "completed"
    assert output(os.path.join(node.work, "e.out")) == "hi\n"
    assert os.path.exists(path)


@pytest.mark.parametrize("text, words", [
    ("#!/bin/sh\n#SBATCH --ntasks=x\ntrue\n", "job.sh, line 2: #SBATCH --ntasks=x"),
    ("#!/bin/sh\n#TETHER --bogus\ntrue\n", "job.sh, line 2: #TETHER --bogus"),
    ("#!/bin/sh\n#TETHER --name a b\ntrue\n", "#TETHER takes options only"),
    ("#!/bin/sh\n#TETHER --state-dir /tmp\ntrue\n", "not an option of a job"),
    ("#!/bin/sh\n#SBATCH -J 'unclosed\ntrue\n", "job.sh, line 2: No closing quotation"),
    ("#!/bin/sh\r\ntrue\r\n", "DOS line breaks"),
    ("#!/bin/sh\n" + "#" * batch.MAX_SCRIPT, "longer than 512 KiB"),
])
def test_a_bad_script_is_refused_at_submit_and_nothing_is_queued(node: Node, text: str,
                                                                 words: str) -> None:
    node.start()
    write(os.path.join(node.work, "job.sh"), text)
    res = node.cli("submit", "job.sh")
    assert res.returncode == USAGE and words in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert json.loads(node.ok("list", "--json")) == []


def test_a_submission_over_one_frame_is_one_line(node: Node) -> None:
    """A script near its limit and a large environment together pass the 1 MiB a request may
    be: one line saying so, not a traceback."""
    node.start()
    write(os.path.join(node.work, "big.sh"), "#!/bin/sh\n" + "# filler\n" * 50000)
    node.env.update({f"BIG{i}": "x" * 100_000 for i in range(6)})
    res = node.cli("submit", "big.sh")
    assert res.returncode == 1 and "over the 1048576 a request may be" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_the_agent_refuses_a_script_it_cannot_keep(node: Node) -> None:
    """The request is checked again: bytes only, and no more than MAX_SCRIPT of them."""
    from tether.shared.client import Client

    node.start()
    with Client(node.layout.sock) as c:
        base = {"command": ["job.sh"], "workdir": node.work, "env": {}}
        for script, why in ((b"x" * (batch.MAX_SCRIPT + 1), "over the limit"),
                            ("text", "the script's bytes"), (b"", "the script's bytes")):
            with pytest.raises(TetherError, match=why):  # the agent's refusal, not any error
                c.call("submit", dict(base, script=script))


@pytest.fixture
def alice() -> Iterator[User]:
    with made_users(1) as users:
        yield users[0]


def test_a_user_s_script_runs_as_her_from_a_copy_only_root_can_read(node: Node,
                                                                     alice: User) -> None:
    shared(node)
    work = home_for(node, alice)
    node.start()
    path = write(os.path.join(work, "mine.sh"),
                 "#!/bin/sh\n#SBATCH -o mine.out\nid -u\nsleep 30\n", 0o600)
    os.chown(path, alice.uid, alice.gid)
    job = int(ok_as(alice, node, "submit", "mine.sh", cwd=work).strip())
    node.wait_state(job, ("running",))
    copy = node.layout.run_dir(job, 1).script
    st = os.stat(copy)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)  # root's: no user reads it
    with open(copy) as f:
        assert f.read() == output(path)
    poll_until(lambda: os.path.exists(os.path.join(work, "mine.out"))
               and output(os.path.join(work, "mine.out")), 30, "the script to print its uid")
    assert output(os.path.join(work, "mine.out")) == f"{alice.uid}\n"
    # the tasks read it from a sealed memfd: the shell's process holds no file of the state dir
    pids = node.job(job)["pids"]
    targets = [os.readlink(f"/proc/{pids[0]}/fd/{fd}") for fd in os.listdir(f"/proc/{pids[0]}/fd")]
    assert any(t.startswith(f"/memfd:tether-script-{job}") for t in targets), targets
    assert not any(t.startswith(node.state) for t in targets), targets
    node.ok("cancel", str(job))
    assert node.wait_end(job)["state"] == "cancelled"


def test_a_script_is_kept_once_for_a_whole_array_and_goes_with_its_last_job(node: Node) -> None:
    node.start()
    write(os.path.join(node.work, "arr.sh"),
          '#SBATCH --array=1-3 -o arr-%a.out\necho "$TETHER_ARRAY_TASK_ID"\n')
    array = int(node.ok("submit", "arr.sh").strip())
    assert node.cli("wait", str(array), "--timeout", "60").returncode == 0
    for i in (1, 2, 3):
        assert output(os.path.join(node.work, f"arr-{i}.out")) == f"{i}\n"
    node.stop()
    db = sqlite3.connect(node.layout.db)
    try:
        assert db.execute("SELECT job, elements FROM job_batch").fetchall() == [(array, 3)]
        # a purge of ended jobs (whoever does it, in any order): the row goes with the last
        db.execute("DELETE FROM jobs WHERE id = ?", (array,))
        db.execute("DELETE FROM jobs WHERE id = ?", (array + 2,))
        db.commit()
        assert db.execute("SELECT count(*) FROM job_batch").fetchone() == (1,)
        db.execute("DELETE FROM jobs WHERE id = ?", (array + 1,))
        db.commit()
        assert db.execute("SELECT count(*) FROM job_batch").fetchone() == (0,)
    finally:
        db.close()


def test_submit_help_shows_both_forms() -> None:
    res = subprocess.run([*CLI, "submit", "--help"], capture_output=True, text=True,
                         timeout=30)
    assert "tether submit [OPTIONS] SCRIPT [ARG...]" in res.stdout
