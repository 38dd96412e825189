"""Fuzz: malformed frames at every socket of the agent and of a running step's supervisor; none
may die.

    python -m bench.fuzz                    # the release run: 10,000 frames per socket
    python -m bench.fuzz --frames 2000

Three sockets, each in its own wire format: the agent's door and the supervisor's door (plain
AF_UNIX streams, a 4-byte length then msgpack: ``shared/framing.py``) and the supervisor's
ROUTER in ``ctl/`` (ZeroMQ, the agent's only). Frames: random bytes, random msgpack (huge and
negative integers, floats, bytes, deep nesting, maps with odd keys), envelopes with known and
unknown kinds and random arguments, multi-part messages and large strings; at a door also
declared lengths over the limit and bytes with no frame header, after which the door closes the
connection and the fuzzer connects again (``reconnects``). Requests that would change something
legitimately (submit, cancel, claim, ack, terminate, signal, abort) are left out: they are
answered, not survived. After every 500 frames and at the end each daemon must be the same
process (boot id, pid, start ticks) and answer a valid request, and every whole frame sent to a
door must have had exactly one reply (``unanswered``: 0). It prints the figures and exits 1 on
any death, silence or unanswered frame.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Any

import msgpack
import zmq

from bench.chaos import Agent, call
from bench.common import kill_tree
from tether.shared import framing, protocol, records
from tether.shared.client import Client
from tether.shared.errors import TetherError
from tether.shared.procid import ProcId
from tether.shared.zmq_client import Client as ZmqClient

AGENT_KINDS = ["hello", "status", "list", "show", "wait"]
SUPERVISOR_KINDS = ["hello", "state", "info", "pids", "stats", "output", "events", "pmi", "wait"]
KEYS = ["job", "attempt", "hold", "after", "limit", "versions", "offset", "lines", "rank",
        "stream", "x", "", "é"]


def value(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(12 if depth < 4 else 8)
    if pick == 0:
        return rng.choice([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)])
    if pick == 1:
        return rng.choice([0.5, -1e308, float("inf"), float("nan"), 1e12])
    if pick == 2:
        return rng.choice([None, True, False])
    if pick == 3:
        return "".join(chr(rng.randrange(1, 0x2FF)) for _ in range(rng.randrange(0, 40)))
    if pick == 4:
        return os.urandom(rng.randrange(0, 40))
    if pick == 5:
        return rng.randrange(-5, 5000)
    if pick == 6:
        return "x" * rng.choice([0, 1, 1000, 70000])
    if pick == 7:
        return rng.choice(KEYS)
    if pick < 10:
        return [value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {rng.choice([*KEYS, 1, None, b"k"]) if rng.random() < 0.8 else value(rng, 5):
            value(rng, depth + 1) for _ in range(rng.randrange(0, 5))}


def pack(obj: Any) -> bytes:
    try:
        return bytes(msgpack.packb(obj, use_bin_type=True))
    except (TypeError, ValueError, OverflowError):
        return b"\xc1"  # msgpack's "never used" byte: garbage all the same


def frames(rng: random.Random, kinds: list[str]) -> list[bytes]:
    pick = rng.randrange(8)
    if pick == 0:
        return [os.urandom(rng.randrange(0, 300))]
    if pick == 1:
        return [pack(value(rng))]
    if pick == 2:
        depth = rng.choice([100, 1000, 5000, 100000])
        return [b"\x91" * depth + b"\xc0"]
    if pick == 3:
        return [os.urandom(rng.randrange(0, 50)) for _ in range(rng.randrange(2, 5))]
    envelope: dict[Any, Any] = {
        "v": rng.choice([1, 1, 1, 2, 0, -1, "1", None, 2**64 - 1]),
        "id": rng.choice([rng.randrange(1, 1 << 30), "s", None, 1.5, True, 2**64 - 1, -1]),
        "kind": rng.choice([*kinds, *kinds, "frobnicate", "", 7, None]),
    }
    if rng.random() < 0.9:
        envelope["args"] = value(rng) if rng.random() < 0.3 else {
            rng.choice(KEYS): value(rng, 2) for _ in range(rng.randrange(0, 4))}
    if envelope["kind"] == "wait":  # parked for long would only measure memory
        envelope.setdefault("args", {})
        if isinstance(envelope["args"], dict):
            envelope["args"]["hold"] = 0
    if rng.random() < 0.1:
        envelope[rng.choice(KEYS)] = value(rng)
    return [pack(envelope)]


def door_bytes(rng: random.Random, kinds: list[str]) -> tuple[bytes, int]:
    """What one fuzz step sends to a door and how many whole frames that is, each of which must
    be answered; 0 frames: it breaks the stream (a declared length over the limit, or bytes
    with no header), and the door closes the connection."""
    pick = rng.randrange(20)
    if pick == 0:
        return framing.HEADER.pack(rng.choice([framing.MAX_FRAME + 1, 2**32 - 1])), 0
    if pick == 1:
        return b"\xff" + os.urandom(rng.randrange(0, 100)), 0  # no header (ZMTP-like)
    parts = frames(rng, kinds)
    return b"".join(framing.frame(p[:framing.MAX_FRAME]) for p in parts), len(parts)


#: the id of the request that marks "every frame before this one is answered"
SYNC_ID = 2**31 - 7


class Target:
    def __init__(self, name: str, path: str, ident: ProcId, probe: str, door: bool) -> None:
        self.name, self.path, self.ident, self.probe = name, path, ident, probe
        self.door = door
        self.sent = self.replies = self.reconnects = 0
        #: whole frames sent to a door, each owed exactly one reply
        self.owed = 0
        self.deaths = 0

    def healthy(self) -> bool:
        if not self.ident.alive():
            return False
        try:
            with (Client(self.path, timeout=5.0) if self.door
                  else ZmqClient(self.path, timeout=5.0)) as c:
                c.call(self.probe, {})
        except TetherError:
            return False
        return True


def fuzz_door(target: Target, count: int, rng: random.Random, kinds: list[str]) -> None:
    """Before each stream-breaking send and at every checkpoint, a valid request is sent and
    the connection read until its reply and a reply to every earlier frame are in (replies may
    come out of order: ``pids`` and ``stats`` wait for a /proc scan)."""
    conn: Conn | None = None
    try:
        for i in range(count):
            if conn is None:
                conn = Conn(target.path)
            data, owed = door_bytes(rng, kinds)
            if not owed:
                target.replies += conn.sync(target.probe)
            conn.sock.sendall(data)
            target.sent += 1
            target.owed += owed
            conn.owed += owed
            if owed:
                target.replies += conn.drain()
            else:
                conn.sock.close()
                conn = None
                target.reconnects += 1
            if (i + 1) % 500 == 0:
                if conn is not None:
                    target.replies += conn.sync(target.probe)
                if not target.healthy():
                    target.deaths += 1
                    return
        if conn is not None:
            target.replies += conn.sync(target.probe)
    except (OSError, ValueError) as exc:
        print(f"{target.name}: {exc}")
        target.deaths += not target.healthy()
    finally:
        if conn is not None:
            conn.sock.close()


class Conn:
    """One connection to a door, with the count of replies still owed on it."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10.0)  # silence this long is an error
        self.sock.connect(path)
        self.deframer = framing.Deframer()
        self.owed = 0

    def sync(self, probe: str) -> int:
        """Send a valid request, read until its reply and every owed one are in; return how
        many replies other than its own came."""
        self.sock.sendall(framing.frame(protocol.encode_request(
            protocol.Request(id=SYNC_ID, kind=probe, args={}, v=1))))
        n, synced = 0, False
        while not synced or self.owed > 0:
            payload = self.deframer.next()
            if payload is None:
                self._read()
            elif protocol.decode_reply(payload).id == SYNC_ID and not synced:
                synced = True
            else:
                n += 1
                self.owed -= 1
        return n

    def drain(self) -> int:
        """The replies already here (unread replies would make the door stop reading)."""
        n = 0
        while select.select([self.sock], [], [], 0)[0]:
            self._read()
            while self.deframer.next() is not None:
                n += 1
                self.owed -= 1
        return n

    def _read(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionResetError("the door closed the connection")
        self.deframer.feed(data)


def fuzz(target: Target, count: int, rng: random.Random, kinds: list[str]) -> None:
    if target.door:
        fuzz_door(target, count, rng, kinds)
        return
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100000)
    sock.connect("ipc://" + target.path)
    try:
        for i in range(count):
            sock.send_multipart(frames(rng, kinds))
            target.sent += 1
            while sock.poll(0, zmq.POLLIN):
                sock.recv_multipart()
                target.replies += 1
            if (i + 1) % 500 == 0:
                while sock.poll(0, zmq.POLLIN):
                    sock.recv_multipart()
                    target.replies += 1
                if not target.healthy():
                    target.deaths += 1
                    return
        while sock.poll(500, zmq.POLLIN):  # the last replies: every frame was answered
            sock.recv_multipart()
            target.replies += 1
    finally:
        sock.close(linger=0)


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    base = tempfile.mkdtemp(dir="/tmp", prefix="tfuzz")
    work = os.path.join(base, "w")
    os.makedirs(work)
    agent = Agent(base, 2)
    t0 = time.monotonic()
    try:
        agent.start()
        assert agent.proc is not None
        job = call(agent.layout, "submit", {"command": ["sleep", "3600"], "workdir": work,
                                            "env": {"PATH": "/usr/bin:/bin"}})["id"]
        rd = agent.layout.run_dir(job, 1)
        deadline = time.monotonic() + 30
        while True:
            try:
                man = records.read_manifest(rd.manifest)
                if man["phase"] == "running":
                    break
            except (FileNotFoundError, records.RecordError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the step did not start")
            time.sleep(0.05)
        agent_ident = ProcId.of(agent.proc.pid)
        assert agent_ident is not None
        sup = ProcId.from_dict(man["supervisor"])
        targets = [
            (Target("agent", agent.layout.sock, agent_ident, "status", True), AGENT_KINDS),
            (Target("supervisor", rd.sock, sup, "state", True), SUPERVISOR_KINDS),
            (Target("supervisor_ctl", rd.ctl_sock, sup, "state", False), SUPERVISOR_KINDS),
        ]
        for target, kinds in targets:
            fuzz(target, args.frames, rng, kinds)
            if target.deaths == 0 and not target.healthy():
                target.deaths += 1
        elapsed = time.monotonic() - t0
    finally:
        if agent.proc is not None and agent.proc.poll() is None:
            agent.proc.send_signal(signal.SIGTERM)
            agent.proc.wait(30)
        kill_tree(agent.state)
        agent.log.close()
    figures: dict[str, Any] = {"seconds": round(elapsed, 1)}
    for target, _ in targets:
        figures[f"{target.name}_frames"] = target.sent
        figures[f"{target.name}_replies"] = target.replies
        if target.door:
            figures[f"{target.name}_reconnects"] = target.reconnects
            figures[f"{target.name}_unanswered"] = target.owed - target.replies
        figures[f"{target.name}_deaths"] = target.deaths
    for key, val in figures.items():
        print(f"{key:>20}: {val}")
    print(json.dumps(figures))
    bad = any(t.deaths or t.sent < args.frames or (t.door and t.owed != t.replies)
              for t, _ in targets)
    if bad:
        print(f"agent log: {agent.log.name}; supervisors.log in {agent.state}")
    else:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=10000, help="frames per socket")
    p.add_argument("--seed", type=int, default=1)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

