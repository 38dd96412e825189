"""Malformed frames sent on a raw connection to a supervisor's door and to the agent's.

Each frame the server can still answer gets one error reply (ok=False, with a code) and changes
nothing; a frame declared over the limit is answered with an error, and that connection (whose
stream cannot be resynchronised) is closed. Afterwards both servers still serve, and the job
still completes normally.

Not covered: a peer that is neither root nor the agent's uid being refused control verbs (that
needs a second uid).
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgpack

from tests.helpers import Node, RawDoor
from tether.shared import framing, protocol
from tether.shared.client import Client


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
    ("one byte", [b"\xc1"], "bad_request", None),
]


def check_cases(raw: RawDoor, cases: list[Case]) -> None:
    problems = []
    for name, frames, code, rid in cases:
        for f in frames:
            raw.send(f)
        reply = raw.reply(name)
        if reply.ok or reply.code != code or reply.id != rid or not reply.message:
            problems.append(f"{name}: got ok={reply.ok} code={reply.code!r} id={reply.id!r} "
                            f"message={reply.message!r}; expected code {code!r} id {rid!r}")
    assert not problems, "\n".join(problems)


def send_oversized(path: str) -> RawDoor:
    """Declare a frame over MAX_FRAME on a connection of its own."""
    raw = RawDoor(path)
    raw.send_raw(framing.HEADER.pack(protocol.MAX_FRAME + 1) + b"x" * 1024)
    return raw


def refused_and_closed(raw: RawDoor) -> None:
    """The oversized sender gets one error (no success), then the door closes its connection."""
    reply = raw.reply("the oversized frame")
    assert not reply.ok and reply.code == "bad_request" and "exceeds" in reply.message, reply
    assert raw.sock.recv(1) == b"", "the connection stayed open after an unreadable frame"


def test_supervisor_answers_malformed_frames_and_keeps_serving(
        node: Node) -> None:
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
    raw = RawDoor(sock)
    big = send_oversized(sock)
    try:
        check_cases(raw, cases)
        with Client(sock, timeout=5) as client:
            st = client.call("state")
            assert (st["job"], st["phase"], st["state"]) == (job, "running", "running"), st
            assert len(st["pids"]) == 1
        # the same raw connection is still served after all of that
        raw.send(req(40, "state", {}))
        assert raw.reply("state after the garbage").unwrap()["phase"] == "running"
        refused_and_closed(big)
    finally:
        raw.close()
        big.close()

    open(os.path.join(node.work, "go"), "w").close()
    end = node.wait_end(job, timeout=30)
    assert (end["state"], end["exit_code"], end["signal"]) == ("completed", 0, None), end
    with open(end["output"]) as f:
        assert f.read() == "done\n"


def test_agent_answers_malformed_frames_and_keeps_serving(
        node: Node) -> None:
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
    raw = RawDoor(node.layout.sock)
    big = send_oversized(node.layout.sock)
    try:
        check_cases(raw, cases)
        raw.send(req(70, "status", {}))
        assert raw.reply("status after the garbage").unwrap()["cpus"]["allocated"] == 0
        refused_and_closed(big)
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

