"""Malformed frames sent with a raw DEALER to a supervisor and to the agent.

Each frame the server can still answer gets one error reply (ok=False, with a code) and changes
nothing; an oversized frame drops the sender's connection inside libzmq. Afterwards both servers
still serve, and the job still completes normally.

Not covered: a peer that is neither root nor the agent's uid being refused control verbs (that
needs a second uid).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from tests.helpers import Node
from tether.shared import protocol
from tether.shared.client import Client

REPLY_TIMEOUT_MS = 5000


def pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj)
    return data


def req(rid: Any, kind: str, args: Any = None, **extra: Any) -> bytes:
    body: dict[str, Any] = {"v": 1, "id": rid, "kind": kind, **extra}
    if args is not None:
        body["args"] = args
    return pack(body)


# (name, frames, expected error code, expected reply id)
Case = tuple[str, list[bytes], str, Any]

COMMON: list[Case] = [
    ("garbage bytes", [b"\xc1\xff not msgpack at all"], "bad_request", None),
    ("empty frame", [b""], "bad_request", None),
    ("truncated msgpack", [b"\x93\x01"], "bad_request", None),
    ("msgpack list", [pack([1, 2, 3])], "bad_request", None),
    ("msgpack string", [pack("status")], "bad_request", None),
    ("map without id", [pack({"v": 1, "kind": "status"})], "bad_request", None),
    ("float id", [pack({"v": 1, "id": 1.5, "kind": "status"})], "bad_request", None),
    ("bool id", [pack({"v": 1, "id": True, "kind": "status"})], "bad_request", None),
    ("no version", [pack({"id": 10, "kind": "hello"})], "bad_request", 10),
    ("no kind", [pack({"v": 1, "id": 11})], "bad_request", 11),
    ("unknown kind", [req(12, "frobnicate", {})], "unknown_kind", 12),
    ("args not a map", [req(13, "hello", [1])], "bad_request", 13),
    ("unknown field", [req(14, "hello", {}, extra=1)], "bad_request", 14),
    ("future version", [pack({"v": 99, "id": 15, "kind": "hello"})], "version", 15),
    ("versions not a list", [req(16, "hello", {"versions": "1"})], "bad_request", 16),
    ("no common version", [req(17, "hello", {"versions": [7, 8]})], "version", 17),
    ("unknown hello arg", [req("s18", "hello", {"versions": [1], "x": 1})], "bad_request",
     "s18"),
    ("two payload frames", [req(19, "hello", {"versions": [1]}),
                            req(20, "hello", {"versions": [1]})], "bad_request", 20),
    ("three frames, garbage", [b"a", b"b", b"\xc1"], "bad_request", None),
]


class Raw:
    """A bare DEALER: sends exactly the frames given, returns the one decoded reply."""

    def __init__(self, ctx: zmq.Context[Any], path: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect("ipc://" + path)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def reply(self, what: str) -> protocol.Reply:
        if not self.sock.poll(REPLY_TIMEOUT_MS, zmq.POLLIN):
            raise AssertionError(f"no reply to {what} within {REPLY_TIMEOUT_MS} ms")
        frames = self.sock.recv_multipart()
        assert len(frames) == 1, f"reply to {what} has {len(frames)} frames"
        return protocol.decode_reply(frames[0])

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    try:
        yield c
    finally:
        c.term()


def check_cases(raw: Raw, cases: list[Case]) -> None:
    problems = []
    for name, frames, code, rid in cases:
        raw.send(frames)
        reply = raw.reply(name)
        if reply.ok or reply.code != code or reply.id != rid or not reply.message:
            problems.append(f"{name}: got ok={reply.ok} code={reply.code!r} id={reply.id!r} "
                            f"message={reply.message!r}; expected code {code!r} id {rid!r}")
    assert not problems, "\n".join(problems)


def send_oversized(ctx: zmq.Context[Any], path: str) -> Raw:
    """Send a > MAX_FRAME request on a connection of its own (libzmq drops that connection)."""
    raw = Raw(ctx, path)
    raw.send([req(99, "status", {"pad": "x" * (protocol.MAX_FRAME + 1024)})])
    return raw


def no_success_on(raw: Raw) -> None:
    """Whatever the oversized sender got (normally nothing at all), it is not a success."""
    while raw.sock.poll(0, zmq.POLLIN):
        reply = protocol.decode_reply(raw.sock.recv())
        assert not reply.ok, reply


def test_supervisor_answers_malformed_frames_and_keeps_serving(
        node: Node, ctx: zmq.Context[Any]) -> None:
    node.start()
    job = node.submit("sh", "-c", "touch started; while [ ! -e go ]; do sleep 0.05; done; "
                                  "echo done")
    node.running_manifest(job)
    sock = node.layout.run_dir(job, 1).sock
    target = {"job": job, "attempt": 1}
    cases = COMMON + [
        ("state with an argument", [req(30, "state", {"x": 1})], "bad_request", 30),
        ("wait with a string job", [req(31, "wait", {"job": "1", "attempt": 1})],
         "bad_request", 31),
        ("wait with a negative hold", [req(32, "wait", {**target, "hold": -1})],
         "bad_request", 32),
        ("terminate with a string grace", [req(33, "terminate", {**target, "grace": "soon"})],
         "bad_request", 33),
        ("terminate with an unknown arg", [req(34, "terminate", {**target, "now": True})],
         "bad_request", 34),
        ("ack without job", [req(35, "ack", {"attempt": 1})], "bad_request", 35),
        ("claim of another attempt", [req(36, "claim", {"job": job, "attempt": 2})],
         "state", 36),
        ("ack before the end", [req(37, "ack", target)], "state", 37),
    ]
    raw = Raw(ctx, sock)
    big = send_oversized(ctx, sock)
    try:
        check_cases(raw, cases)
        with Client(sock, timeout=5, ctx=ctx) as client:
            st = client.call("state")
            assert (st["job"], st["phase"], st["state"]) == (job, "running", "running"), st
            assert len(st["pids"]) == 1
        # the same raw connection is still served after all of that
        raw.send([req(40, "state", {})])
        assert raw.reply("state after the garbage").unwrap()["phase"] == "running"
        no_success_on(big)
    finally:
        raw.close()
        big.close()

    open(os.path.join(node.work, "go"), "w").close()
    end = node.wait_end(job, timeout=30)
    assert (end["state"], end["exit_code"], end["signal"]) == ("completed", 0, None), end
    with open(end["output"]) as f:
        assert f.read() == "done\n"


def test_agent_answers_malformed_frames_and_keeps_serving(
        node: Node, ctx: zmq.Context[Any]) -> None:
    node.start()
    job = node.submit("true")
    assert node.wait_end(job)["state"] == "completed"
    listed = node.ok("list", "--json")
    good = {"command": ["true"], "workdir": node.work}
    cases = COMMON + [
        ("status with an argument", [req(50, "status", {"x": 1})], "bad_request", 50),
        ("show with a string job", [req(51, "show", {"job": "1"})], "bad_request", 51),
        ("show with job 0", [req(52, "show", {"job": 0})], "bad_request", 52),
        ("show of no job", [req(53, "show", {"job": 4242})], "not_found", 53),
        ("cancel with a float job", [req(54, "cancel", {"job": 1.0})], "bad_request", 54),
        ("wait with a huge hold", [req(55, "wait", {"job": job, "hold": 1e12})],
         "bad_request", 55),
        ("submit with a string command", [req(56, "submit", {**good, "command": "true"})],
         "bad_request", 56),
        ("submit with an empty command", [req(57, "submit", {**good, "command": []})],
         "bad_request", 57),
        ("submit with string cpus", [req(58, "submit", {**good, "cpus": "2"})],
         "bad_request", 58),
        ("submit with bool ntasks", [req(59, "submit", {**good, "ntasks": True})],
         "bad_request", 59),
        ("submit with env not a map", [req(60, "submit", {**good, "env": ["A=b"]})],
         "bad_request", 60),
        ("submit with a relative workdir", [req(61, "submit", {**good, "workdir": "w"})],
         "bad_request", 61),
        ("submit with an unknown arg", [req(62, "submit", {**good, "priority": 1})],
         "bad_request", 62),
        ("submit without workdir", [req(63, "submit", {"command": ["true"]})],
         "bad_request", 63),
        # integers SQLite cannot hold were answered `internal` (an OverflowError each)
        ("show job 2^63", [req(64, "show", {"job": 1 << 63})], "bad_request", 64),
        ("wait job 2^64-1", [req(65, "wait", {"job": (1 << 64) - 1})], "bad_request", 65),
        ("cancel job 2^63", [req(66, "cancel", {"job": 1 << 63})], "bad_request", 66),
        ("list after 2^63", [req(67, "list", {"after": 1 << 63})], "bad_request", 67),
    ]
    raw = Raw(ctx, node.layout.sock)
    big = send_oversized(ctx, node.layout.sock)
    try:
        check_cases(raw, cases)
        raw.send([req(70, "status", {})])
        assert raw.reply("status after the garbage").unwrap()["cpus"]["allocated"] == 0
        no_success_on(big)
    finally:
        raw.close()
        big.close()

    st = node.status()
    assert st["cpus"] == {"total": 4, "allocated": 0}
    assert node.ok("list", "--json") == listed, "a malformed request queued or changed a job"
    # and it still runs jobs
    again = node.submit("true")
    assert node.wait_end(again)["state"] == "completed"
    assert json.loads(node.ok("list", "--json"))[-1]["id"] == again

