"""Untrusted users against the daemons' doors (issue 7: attacks 1 to 5, and a flood).

The attacker is a real other user, created here; the victim is another. Each attack must leave
the owner's job running to its true end, with its full output, and the daemons within bounds.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
from collections.abc import Iterator

import pytest

from tests.helpers import Node, foreign_python
from tests.userkit import User, cli_as, home_for, made_users, ok_as, rss_kb, run_as, shared

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")

#: The attacker's tools, run as the attacker: ``python -c ATTACK MODE PATH ...``.
ATTACK = r'''
import os, socket, struct, sys, time
mode, path = sys.argv[1], sys.argv[2]

def frame(data):
    return struct.pack(">I", len(data)) + data

def pack(obj):
    import msgpack
    return msgpack.packb(obj)

if mode == "zmq-ids":  # attack 1: proposed routing ids the ROUTER's own counter will reach
    import zmq
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 4096)
    socks = []
    for i in range(200):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, b"\x00" + (0x6B8B4567 + i).to_bytes(4, "big"))
        s.connect("ipc://" + path)
        socks.append(s)
    for _ in range(70):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect("ipc://" + path)
        socks.append(s)
    time.sleep(float(sys.argv[3]))
    for s in socks:
        s.close(0)
    ctl = os.path.join(os.path.dirname(path), "ctl", "sock")
    if os.path.lexists(ctl) or os.path.isdir(os.path.dirname(ctl)):
        try:
            socket.socket(socket.AF_UNIX).connect(ctl)
            print("reached ctl")
        except PermissionError:
            pass
    print("done", flush=True)

elif mode == "thief":  # attack 2: take over other peers' connections and their replies
    import zmq
    ctx = zmq.Context()
    socks = []
    for i in range(20):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, b"\x00" + (0x6B8B4567 + i).to_bytes(4, "big"))
        s.connect("ipc://" + path)
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    print("ready", flush=True)
    got = 0
    end = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < end:
        for s, _ in poller.poll(100):
            got += len(s.recv())
    print("stolen", got, flush=True)

elif mode == "conns":  # attack 3: hold many plain connections open
    n, hold = int(sys.argv[3]), float(sys.argv[4])
    held, refused = [], 0
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
        except OSError:
            refused += 1
            s.close()
            continue
        held.append(s)
    print("connected", len(held), "refused", refused, flush=True)
    time.sleep(hold)
    print("done", flush=True)

elif mode == "bigfields":  # attack 4: bad requests full of the sender's text
    n = int(sys.argv[3])
    body = pack({"v": 1, "id": 1, "kind": "state", "args": {}, "X" * (1000 * 1000): 1})
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(frame(body))
        s.recv(1)
        s.close()
    print("done", flush=True)

elif mode == "zmq-bigfields":  # attack 4, as a ZeroMQ client (the old doors' own protocol)
    import zmq
    n = int(sys.argv[3])
    body = pack({"v": 1, "id": 1, "kind": "state", "args": {}, "X" * (1000 * 1000): 1})
    ctx = zmq.Context()
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect("ipc://" + path)
        s.send(body)
        s.poll(5000)
        s.close(0)
    print("done", flush=True)

elif mode == "zmq-unread":  # attack 5: replies never read, as a ZeroMQ client
    import zmq
    total, wait = int(sys.argv[3]), float(sys.argv[4])
    body = pack({"v": 1, "id": 1, "kind": "state", "args": {}, "Y" * 500_000: 1})
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.setsockopt(zmq.SNDHWM, 1000000)
    s.connect("ipc://" + path)
    print("connected", flush=True)
    sent = 0
    while sent < total:
        s.send(body)
        sent += len(body)
    time.sleep(wait)
    print("sent", sent, flush=True)
    time.sleep(float(sys.argv[5]))

elif mode == "unread":  # the flood: replies never read
    total, conns, wait = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    body = frame(pack({"v": 1, "id": 1, "kind": "state", "args": {}, "Y" * 500_000: 1}))
    socks = [socket.socket(socket.AF_UNIX) for _ in range(conns)]
    for s in socks:
        s.connect(path)
        s.setblocking(False)
    print("connected", flush=True)
    sent, end = 0, time.monotonic() + wait
    pending = {s: memoryview(body) for s in socks}
    while sent < total and pending and time.monotonic() < end:
        for s in list(pending):
            try:
                n = s.send(pending[s])
            except BlockingIOError:
                continue
            except OSError:
                del pending[s]
                continue
            pending[s] = pending[s][n:]
            if not pending[s]:
                sent += len(body)
                pending[s] = memoryview(body)
        time.sleep(0.001)
    print("sent", sent, flush=True)
    time.sleep(float(sys.argv[6]) if len(sys.argv) > 6 else 0)

elif mode == "garbage":  # the flood: malformed frames, and connections coming and going
    frames, churn = int(sys.argv[3]), int(sys.argv[4])
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    print("connected", flush=True)
    bad = [b"\xc1", pack([1, 2]), pack({"id": 1}), pack({"v": 1, "id": 2, "kind": "nope"}),
           b"\x00" * 100]
    out = b"".join(frame(bad[i % len(bad)]) for i in range(frames))
    s.setblocking(True)
    answered = 0
    import threading
    def reader():
        global answered
        buf = b""
        while answered < frames:
            data = s.recv(1 << 16)
            if not data:
                return
            buf += data
            while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
                n = struct.unpack(">I", buf[:4])[0]
                buf = buf[4 + n:]
                answered += 1
    t = threading.Thread(target=reader)
    t.start()
    s.sendall(out)
    churned = 0
    for _ in range(churn):
        c = socket.socket(socket.AF_UNIX)
        try:
            c.connect(path)
            churned += 1
        except OSError:
            pass
        c.close()
    t.join(60)
    print("answered", answered, "churned", churned, flush=True)

elif mode == "rate":  # many valid requests on one connection, as fast as the door answers
    n = int(sys.argv[3])
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    out = b"".join(frame(pack({"v": 1, "id": i, "kind": "status", "args": {}}))
                   for i in range(n))
    import threading
    sender = threading.Thread(target=s.sendall, args=(out,))
    start = time.monotonic()
    sender.start()
    times, buf = [], b""
    while len(times) < n:
        data = s.recv(1 << 16)
        if not data:
            break
        buf += data
        while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
            buf = buf[4 + struct.unpack(">I", buf[:4])[0]:]
            times.append(time.monotonic() - start)
    sender.join(60)
    print(" ".join(f"{t:.4f}" for t in times), flush=True)
'''


@pytest.fixture
def two() -> Iterator[list[User]]:
    with made_users(2) as users:
        yield users


def attack(bob: User, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_as(bob, ["-c", ATTACK, *args], timeout=timeout)


def start_attack(bob: User, *args: str) -> subprocess.Popen[str]:
    python, env = foreign_python()
    return subprocess.Popen([*python, "-c", ATTACK, *args], user=bob.uid, group=bob.gid,
                            extra_groups=[], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd="/", env=dict(env, PATH="/usr/bin:/bin"))


#: A job that ends (printing "end") once the test opens its gate.
GATED = "while [ ! -e go ]; do sleep 0.05; done; echo end"


def open_gate(node: Node, alice: User) -> None:
    open(os.path.join(node.dir, alice.name, "go"), "w").close()


def stop(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.kill()
    p.communicate()


def running_job(node: Node, alice: User, script: str) -> tuple[int, int, str]:
    """A job of alice's, running: (job id, supervisor pid, door path)."""
    shared(node)
    work = home_for(node, alice)
    node.start()
    # root's --user: what the release before the doors could do too, so that each attack
    # below meets the old daemons' real weakness rather than a missing feature
    job = node.submit("sh", "-c", script, opts=("--user", alice.name, "--workdir", work))
    node.wait_state(job, ("running",))
    sup = node.running_manifest(job)["supervisor"]["pid"]
    return job, sup, node.layout.run_dir(job, 1).sock


def ends_well(node: Node, job: int, sup: int, expect: str) -> None:
    j = node.wait_end(job, timeout=90)
    assert (j["state"], j["exit_code"]) == ("completed", 0), j
    assert j["supervisor_pid"] == sup
    with open(j["output"]) as f:
        assert f.read() == expect


def test_attack1_proposed_routing_ids_cannot_abort_a_supervisor(node: Node,
                                                                two: list[User]) -> None:
    alice, bob = two
    job, sup, door = running_job(node, alice, GATED)
    res = attack(bob, "zmq-ids", door, "3")
    assert res.returncode == 0 and "done" in res.stdout, res.stderr
    assert "reached ctl" not in res.stdout, "another user reached the supervisor's ZeroMQ socket"
    assert node.job(job)["state"] == "running"
    open_gate(node, alice)
    ends_well(node, job, sup, "end\n")


def test_attack2_nobody_takes_over_another_peers_replies(node: Node, two: list[User]) -> None:
    alice, bob = two
    job, sup, door = running_job(node, alice, "while [ ! -e go ]; do sleep 0.05; done; "
                                              "echo for alice only")
    follow = """
import sys
from tether.shared.step_client import connect
with connect(int(sys.argv[1]), state_dir=sys.argv[2]) as step:
    for _name, data in step.follow_output():
        sys.stdout.write(data.decode())
"""
    python, env = foreign_python()
    follower = subprocess.Popen([*python, "-c", follow, str(job), node.state], user=alice.uid,
                                group=alice.gid, extra_groups=[], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd="/",
                                env=dict(env, PATH="/usr/bin:/bin"))
    thief = start_attack(bob, "thief", door, "4")
    try:
        assert thief.stdout is not None and thief.stdout.readline() == "ready\n"
        open(os.path.join(node.dir, alice.name, "go"), "w").close()
        out, err = follower.communicate(timeout=60)
        stolen, _ = thief.communicate(timeout=60)
    finally:
        for p in (follower, thief):
            stop(p)
    assert out == "for alice only\n", err
    assert "stolen 0" in stolen, stolen
    ends_well(node, job, sup, "for alice only\n")


def test_attack3_a_connection_flood_is_capped(node: Node, two: list[User]) -> None:
    alice, bob = two
    job, sup, door = running_job(node, alice, GATED)
    # a common soft limit (systemd's default): the flood must not exhaust it
    resource.prlimit(sup, resource.RLIMIT_NOFILE, (1024, 1024))
    flood = start_attack(bob, "conns", door, "1200", "8")
    try:
        assert flood.stdout is not None
        line = flood.stdout.readline()
        assert line.startswith("connected"), line
        held = int(line.split()[1])
        # the owner and root still get through while the flood holds its connections
        assert json.loads(ok_as(alice, node, "inspect", str(job), "--json"))["state"] == \
            "running"
        assert json.loads(node.ok("inspect", str(job), "--json"))["state"] == "running"
        # and the flooder's own next connection is told why, in one line
        res = cli_as(bob, node, "inspect", str(job))
        assert res.returncode == 1 and "holds 64 connections" in res.stderr, res.stderr
        open_fds = len(os.listdir(f"/proc/{sup}/fd"))
    finally:
        stop(flood)
    assert open_fds < 200, f"the supervisor holds {open_fds} fds for {held} connections"
    open_gate(node, alice)
    ends_well(node, job, sup, "end\n")


def test_attack4_bad_requests_are_logged_briefly(node: Node, two: list[User]) -> None:
    alice, bob = two
    job, sup, door = running_job(node, alice, GATED)
    log = os.path.join(node.state, "supervisors.log")
    before = os.path.getsize(log)
    res = attack(bob, "zmq-bigfields", door, "30")
    assert res.returncode == 0, res.stderr
    grown = os.path.getsize(log) - before
    assert grown < 20_000, f"30 bad requests of 1 MB grew the log by {grown} bytes"
    open_gate(node, alice)
    ends_well(node, job, sup, "end\n")


def test_attack5_unread_replies_do_not_grow_a_supervisor(node: Node, two: list[User]) -> None:
    alice, bob = two
    job, sup, door = running_job(node, alice, GATED)
    before = rss_kb(sup)
    # 400 requests of 0.5 MB, each answered by an error that echoes it, never read
    attacker = start_attack(bob, "zmq-unread", door, str(200 << 20), "5", "3")
    try:
        assert attacker.stdout is not None
        assert attacker.stdout.readline() == "connected\n"
        line = attacker.stdout.readline()
        assert line.startswith("sent"), line
        grown = (rss_kb(sup) - before) // 1024
    finally:
        stop(attacker)
    assert grown < 64, f"the supervisor grew by {grown} MB"
    open_gate(node, alice)
    ends_well(node, job, sup, "end\n")


def test_a_flood_of_another_user_leaves_both_daemons_serving(node: Node,
                                                             two: list[User]) -> None:
    """2,000 connections, 10,000 malformed frames and 50 MB of unread replies, at the agent
    and at the supervisor of a running job of another user: the job completes with its full
    output, and neither daemon grows by 64 MB."""
    alice, bob = two
    job, sup, door = running_job(node, alice, "seq 1 10000; while [ ! -e go ]; do sleep 0.05; "
                                              "done; seq 10001 20000")
    assert node.agent is not None
    agent = node.agent.pid
    before = {sup: rss_kb(sup), agent: rss_kb(agent)}
    attackers = []
    try:
        for path in (door, node.layout.sock):
            # the frames and the unread replies first: the connection flood then takes the
            # rest of this user's connections, and every later one of its is refused
            for args in (("garbage", path, "5000", "500"),
                         ("unread", path, str(25 << 20), "8", "5", "3")):
                a = start_attack(bob, *args)
                attackers.append(a)
                assert a.stdout is not None and a.stdout.readline() == "connected\n"
            attackers.append(start_attack(bob, "conns", path, "1000", "6"))
        results = []
        for a in attackers:
            out, err = a.communicate(timeout=120)
            results.append(out.replace("connected\n", ""))
            assert a.returncode == 0, err
        grown = {pid: (rss_kb(pid) - kb) // 1024 for pid, kb in before.items()}
    finally:
        for a in attackers:
            stop(a)
    answered = [int(r.split()[1]) for r in results if r.startswith("answered")]
    assert answered == [5000, 5000], results
    assert grown[sup] < 64 and grown[agent] < 64, grown
    open(os.path.join(node.dir, alice.name, "go"), "w").close()
    ends_well(node, job, sup, "".join(f"{i}\n" for i in range(1, 20001)))
    assert node.cli("status").returncode == 0


def test_a_users_request_rate_is_capped_and_nothing_is_dropped(node: Node,
                                                               two: list[User]) -> None:
    """6,000 pipelined `status` requests of one user at the agent's door: every one answered,
    but never faster than the uid's token bucket allows (a burst of 2,000, then 1,000 a
    second), while root, who is not rate-limited, is answered meanwhile."""
    from tether.shared.door_caps import Limits
    lim = Limits()
    _, bob = two
    shared(node)
    node.start()
    n = 6000
    a = start_attack(bob, "rate", node.layout.sock, str(n))
    try:
        # root is answered while bob's bucket is empty (bob needs 4 s or more for his)
        assert node.cli("status").returncode == 0
        assert a.poll() is None, "bob was answered before root"
        out, err = a.communicate(timeout=120)
    finally:
        stop(a)
    assert a.returncode == 0, err
    times = [float(t) for t in out.split()]
    assert len(times) == n, f"{len(times)} of {n} answered"
    # the i-th reply (1-based) cannot come before the bucket held i tokens: burst + rate * t,
    # plus the requests of one connection the door lets be in flight at once
    over = [(i, t) for i, t in enumerate(times, 1)
            if i > lim.burst + lim.rate * t + lim.inflight_per_conn]
    assert not over, f"answered faster than the cap: {over[:3]}"
    assert times[-1] >= (n - lim.burst - lim.inflight_per_conn) / lim.rate
