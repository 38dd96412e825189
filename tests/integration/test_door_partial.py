"""A user past her partial-frame cap at a door waits, and only she (issue 27, N2): the door
reads on the connection of hers holding the most of a frame, and once that frame is taken the
others go on; it used to stop reading all of her connections for good.

The user is a real other user, created here and removed afterwards."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from tests.helpers import Node, foreign_python
from tests.userkit import User, cli_as, made_users, shared
from tether.shared.door_caps import Limits

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")

#: Run as the user: N connections, each sending all but the last 10 KB of a 1,000,000-byte
#: request frame, without blocking, until every one has sent that much or none has been read
#: from for a second (the door stopped reading); then the rest of every frame, each from a
#: thread of its own, and one reply read on each. Prints how many were answered.
PARTIAL = r'''
import socket, struct, sys, threading, time
import msgpack
path, n = sys.argv[1], int(sys.argv[2])
size, rest = 1_000_000, 10_000
body = msgpack.packb({"v": 1, "id": 1, "kind": "status", "args": {"pad": ""}})
body = msgpack.packb({"v": 1, "id": 1, "kind": "status",
                      "args": {"pad": "x" * (size - len(body) - 4)}})
assert len(body) == size, len(body)
frame = struct.pack(">I", len(body)) + body
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.setblocking(False)
    socks.append(s)
sent = [0] * n
quiet = time.monotonic()
while time.monotonic() - quiet < 1.0 and min(sent) < len(frame) - rest:
    for i, s in enumerate(socks):
        if sent[i] < len(frame) - rest:
            try:
                k = s.send(frame[sent[i]:len(frame) - rest])
            except BlockingIOError:
                continue
            sent[i] += k
            quiet = time.monotonic()
    time.sleep(0.001)
print("sent", sum(sent), flush=True)
answered = []

def finish(i):
    s = socks[i]
    s.settimeout(60)
    s.sendall(frame[sent[i]:])
    head = b""
    while len(head) < 4:
        head += s.recv(4 - len(head))
    (length,) = struct.unpack(">I", head)
    got = b""
    while len(got) < length:
        got += s.recv(length - len(got))
    answered.append(msgpack.unpackb(got)["id"])

threads = [threading.Thread(target=finish, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("answered", len(answered), flush=True)
'''


@pytest.fixture
def two() -> Iterator[list[User]]:
    with made_users(2) as users:
        yield users


def test_a_user_past_her_partial_frame_cap_is_paused_not_stopped(node: Node,
                                                                 two: list[User]) -> None:
    """8 connections of bob's each send 99% of a 1 MB request: the door takes his first 4 MiB
    and pauses; alice and root are answered meanwhile; then the ends follow, and every one of
    the 8 is answered."""
    alice, bob = two
    shared(node)
    node.start()
    python, penv = foreign_python()
    attacker = subprocess.Popen([*python, "-c", PARTIAL, node.layout.sock, "8"], user=bob.uid,
                                group=bob.gid, extra_groups=[], cwd="/", text=True,
                                env=dict(penv, PATH="/usr/bin:/bin"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    try:
        assert attacker.stdout is not None
        sent = attacker.stdout.readline()
        assert sent.startswith("sent"), sent + (attacker.stderr.read()
                                                if attacker.stderr else "")
        # the door stopped taking his bytes past his cap, not before
        assert int(sent.split()[1]) > Limits().in_per_uid
        assert cli_as(alice, node, "status").returncode == 0
        assert node.cli("status").returncode == 0
        out, err = attacker.communicate(timeout=90)
    finally:
        if attacker.poll() is None:
            attacker.kill()
            attacker.wait()
    assert attacker.returncode == 0, err
    assert out.splitlines()[-1] == "answered 8", out + err
    assert node.cli("status").returncode == 0
