"""Other users: per-request authorization from kernel credentials, and jobs run as other users.

Clients run as real other users (``nobody`` and a test user created here), through the same
interpreter (Debian's python, reachable by every user)."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
from collections.abc import Iterator

import pytest

from tests.helpers import Node, default_output, foreign_python, poll_until
from tests.userkit import made_users
from tether.shared import records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")

CALLS = """
import json, sys
from tether.shared.client import Client
from tether.shared.errors import RemoteError, Unreachable
sock, job, attempt, kinds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
target = {"job": job, "attempt": attempt}
ARGS = {"hello": {"versions": [1]}, "claim": target, "ack": target, "abort": target,
        "wait": dict(target, hold=0), "terminate": dict(target, grace=1),
        "signal": {"signal": 0}, "output": {"lines": 1}}
out = {}
with Client(sock, timeout=5) as c:
    for kind in kinds:
        try:
            c.call(kind, ARGS.get(kind, {}))
            out[kind] = "ok"
        except RemoteError as exc:
            out[kind] = exc.code
print(json.dumps(out))
"""

OWNER_VERBS = ["info", "pids", "stats", "output", "events", "signal"]
AGENT_VERBS = ["claim", "wait", "ack", "abort", "terminate"]


@pytest.fixture(scope="module")
def other_user() -> Iterator[pwd.struct_passwd]:
    """A user made for this module (a unique name), removed afterwards."""
    with made_users(1) as (user,):
        yield pwd.getpwnam(user.name)


def as_user(user: str, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    pw = pwd.getpwnam(user)
    python, env = foreign_python()
    return subprocess.run([*python, "-c", code, *args], user=pw.pw_uid, group=pw.pw_gid,
                          extra_groups=[], capture_output=True, text=True, cwd="/",
                          env=dict(env, PATH="/usr/bin:/bin"), timeout=60)


def calls(user: str, node: Node, job: int, kinds: list[str]) -> dict[str, str]:
    res = as_user(user, CALLS, node.layout.run_dir(job, 1).sock, str(job), "1", *kinds)
    assert res.returncode == 0, res.stderr
    out: dict[str, str] = json.loads(res.stdout)
    return out


def shared_node(node: Node, owner: str) -> str:
    """Let other users reach the state dir (tests' temp dirs start 0700); a work dir for owner."""
    os.chmod(node.dir, 0o755)
    work = os.path.join(node.dir, "owned")
    os.mkdir(work)
    pw = pwd.getpwnam(owner)
    os.chown(work, pw.pw_uid, pw.pw_gid)
    return work


def test_authorization_per_verb_and_class(node: Node, other_user: pwd.struct_passwd) -> None:
    work = shared_node(node, "nobody")
    node.start()
    job = node.submit("sleep", "30", opts=("--user", "nobody", "--workdir", work))
    node.wait_state(job, ("running",))
    # a stranger: may see the state, nothing else
    stranger = calls(other_user.pw_name, node, job, ["hello", "state", *OWNER_VERBS, *AGENT_VERBS])
    assert stranger["hello"] == "ok" and stranger["state"] == "ok"
    assert {k: v for k, v in stranger.items() if k not in ("hello", "state")} == dict.fromkeys(
        OWNER_VERBS + AGENT_VERBS, "permission_denied")
    # the owner: its own job's introspection and signals, but never the agent's verbs
    owner = calls("nobody", node, job, ["state", *OWNER_VERBS, *AGENT_VERBS])
    assert all(owner[k] != "permission_denied" for k in ["state", *OWNER_VERBS]), owner
    assert all(owner[k] == "permission_denied" for k in AGENT_VERBS), owner
    # refusals are logged with the peer's uid: the contract (docs/security.md), no state
    with open(os.path.join(node.state, "supervisors.log")) as f:
        log = f.read()
    # (at most once per connection per second: these all came on one)
    assert f"uid {other_user.pw_uid} pid" in log and "refused" in log
    j = node.job(job)
    assert j["state"] == "running", "a refused request changed the job"
    node.ok("cancel", str(job))
    assert node.wait_end(job)["state"] == "cancelled"


def test_malformed_requests_from_another_user_get_errors(node: Node,
                                                         other_user: pwd.struct_passwd) -> None:
    shared_node(node, "nobody")
    node.start()
    job = node.submit("sleep", "2")
    node.wait_state(job, ("running",))
    code = """
import socket, struct, sys, msgpack
s = socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect(sys.argv[1])
buf = b""
def reply():
    global buf
    while True:
        if len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
            n = struct.unpack(">I", buf[:4])[0]
            rep, buf = msgpack.unpackb(buf[4:4 + n]), buf[4 + n:]
            return rep
        data = s.recv(65536)
        if not data:
            sys.exit("connection closed")
        buf += data
frames = [b"garbage", msgpack.packb([1, 2]), msgpack.packb({"id": 1}),
          msgpack.packb({"v": 1, "id": 2, "kind": "nope", "args": {}}),
          msgpack.packb({"v": 1, "id": 3, "kind": "state", "args": {"x": 1}}),
          msgpack.packb({"v": 9, "id": 4, "kind": "state", "args": {}})]
for f in frames:
    s.sendall(struct.pack(">I", len(f)) + f)
    rep = reply()
    assert rep["ok"] is False and rep["error"]["code"], rep
big = socket.socket(socket.AF_UNIX); big.settimeout(5); big.connect(sys.argv[1])
big.sendall(struct.pack(">I", 2 << 20) + b"x" * 4096)  # over MAX_FRAME: refused, closed
f = msgpack.packb({"v": 1, "id": 5, "kind": "state", "args": {}})
s.sendall(struct.pack(">I", len(f)) + f)
assert reply()["ok"] is True
print("ok")
"""
    for user in (other_user.pw_name, "nobody"):
        res = as_user(user, code, node.layout.run_dir(job, 1).sock)
        assert res.stdout.strip() == "ok", res.stderr
    assert node.wait_end(job)["state"] == "completed"


def test_job_as_another_user(node: Node, other_user: pwd.struct_passwd) -> None:
    work = shared_node(node, other_user.pw_name)
    node.start()
    rd = node.layout.run_dir(1, 1)
    script = (
        'grep -E "^(Uid|Gid):" /proc/self/status; echo "$HOME $USER $LOGNAME"; '
        f'for f in {rd.manifest} {rd.spec}; do '
        '  (echo x >> "$f") 2>/dev/null && echo "WROTE $f"; '
        '  mv "$f" "$f.x" 2>/dev/null && echo "MOVED $f"; '
        'done; '
        f'ln -s /etc/passwd {rd.path}/exit.json 2>/dev/null && echo PLANTED; '
        'echo done'
    )
    job = node.submit("sh", "-c", script, opts=("--user", other_user.pw_name, "--workdir", work))
    assert job == 1
    j = node.wait_end(job)
    assert (j["state"], j["user"], j["uid"]) == ("completed", other_user.pw_name, other_user.pw_uid)
    out = default_output(work, job)
    st = os.stat(out)
    assert (st.st_uid, st.st_gid) == (other_user.pw_uid, other_user.pw_gid)
    with open(out) as f:
        text = f.read()
    uid, gid = other_user.pw_uid, other_user.pw_gid
    assert f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}" in text
    assert f"Gid:\t{gid}\t{gid}\t{gid}\t{gid}" in text
    assert f"{other_user.pw_dir} {other_user.pw_name} {other_user.pw_name}" in text
    assert "WROTE" not in text and "MOVED" not in text and "PLANTED" not in text
    assert text.rstrip().endswith("done")


def test_run_dir_and_records_are_root_only(node: Node) -> None:
    shared_node(node, "nobody")
    node.start()
    job = node.submit("sleep", "1")
    node.wait_state(job, ("running",))
    rd = node.layout.run_dir(job, 1)
    assert os.stat(rd.path).st_mode & 0o777 == 0o711
    for path in (rd.spec, rd.manifest):
        st = os.stat(path)
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600)
    assert os.stat(node.layout.db).st_mode & 0o077 == 0
    poll_until(lambda: os.path.exists(rd.sentinel) or not os.path.exists(rd.path), 30,
               "the exit record")
    node.wait_end(job)


def test_unwritable_or_planted_output_is_refused_before_launch(
        node: Node, other_user: pwd.struct_passwd) -> None:
    work = shared_node(node, other_user.pw_name)
    node.start()
    # a directory the user cannot write
    res = node.cli("submit", "--user", other_user.pw_name, "--workdir", work, "--output",
                   "/etc/out.txt", "--", "true")
    assert res.returncode == 1 and "cannot create /etc/out.txt" in res.stderr
    # a link the user planted where the output will go, aiming at a file only root may write
    secret = os.path.join(node.dir, "rootfile")
    with open(secret, "w") as f:
        f.write("root's\n")
    os.chmod(secret, 0o600)
    link = os.path.join(work, "out.txt")
    os.symlink(secret, link)
    os.lchown(link, other_user.pw_uid, other_user.pw_gid)
    res = node.cli("submit", "--user", other_user.pw_name, "--workdir", work, "--output", link,
                   "--", "echo", "overwritten")
    assert res.returncode == 1 and "not a regular file" in res.stderr
    assert node.ok("list", "--json") == "[]\n", "a refused job was recorded"
    with open(secret) as f:
        assert f.read() == "root's\n"


def test_link_planted_between_submit_and_launch_is_not_followed(
        node: Node, other_user: pwd.struct_passwd) -> None:
    work = shared_node(node, other_user.pw_name)
    node.start()
    blocker = node.submit("sleep", "30", opts=("--cpus", "4"))
    node.wait_state(blocker, ("running",))
    out = os.path.join(work, "late.txt")
    job = node.submit("echo", "overwritten", opts=("--user", other_user.pw_name, "--workdir", work,
                                                   "--output", out, "--cpus", "4"))
    secret = os.path.join(node.dir, "rootfile")
    with open(secret, "w") as f:
        f.write("root's\n")
    os.chmod(secret, 0o600)
    os.symlink(secret, out)  # planted while the job waits in the queue
    os.lchown(out, other_user.pw_uid, other_user.pw_gid)
    node.ok("cancel", str(blocker))
    j = node.wait_end(job)
    assert (j["state"], j["exit_code"]) == ("failed", 127)
    assert "cannot open output file" in j["reason"]
    with open(secret) as f:
        assert f.read() == "root's\n"
    assert records  # (records imported for symmetry with other tests)


def test_user_needs_a_root_agent_and_a_known_user(node: Node) -> None:
    node.start()
    res = node.cli("submit", "--user", "no-such-user-here", "--", "true")
    assert res.returncode == 1 and "no such user" in res.stderr


def test_output_is_read_through_the_launch_fd_not_the_path(
        node: Node, other_user: pwd.struct_passwd) -> None:
    """The job's user swaps its output file for a link to a root-only file: inspect --output
    (run as root) still shows the job's own output, never the secret."""
    work = shared_node(node, other_user.pw_name)
    secret = os.path.join(node.dir, "secret")
    with open(secret, "w") as f:
        f.write("TOP SECRET\n")
    os.chmod(secret, 0o600)
    node.start()
    out = os.path.join(work, "o.txt")
    job = node.submit("sh", "-c", f'echo mine; mv {out} {out}.old; ln -s {secret} {out}; '
                                  'echo swapped > swapped; sleep 30',
                      opts=("--user", other_user.pw_name, "--workdir", work, "--output", out))
    poll_until(lambda: os.path.exists(os.path.join(work, "swapped")), 30, "the swap")
    shown = node.ok("inspect", str(job), "--output", "--lines", "10")
    assert "mine" in shown and "TOP SECRET" not in shown
    node.ok("cancel", str(job))
    node.wait_end(job)
