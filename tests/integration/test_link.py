"""The agent's link to a supervisor (agent/link.py: one DEALER) against real peers in their own
processes: this release's ROUTER (supervisor/ctl.py), the ctl door of 0.5.0 and 0.6.0 (ZMTP
answered by hand), a plain libzmq ROUTER (0.2.0 to 0.4.0), a peer that binds late, one that
never answers and one that refuses, through the agent's own poller."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from tether.agent.link import Link
from tether.agent.poller import Poller
from tether.shared.errors import TetherError
from tether.shared.timers import Timers

PEER = r"""
import os, select, socket, sys, time
import zmq
from tether.shared import protocol, zmtp
from tether.shared.errors import Busy

mode, path, log = sys.argv[1], sys.argv[2], sys.argv[3]

def note(text):
    with open(log, "a") as f:
        f.write(text + "\n")

def result(req, **more):
    note(f"request {req.kind} {req.id}")
    return {"pong": req.kind, "pid": os.getpid(), **more}

def go():
    while not os.path.exists(log + ".go"):
        time.sleep(0.01)

if mode in ("ctl", "ctl-exit"):  # this release's supervisor: ctl.py on a kept listening socket
    from tether.supervisor import handover
    from tether.supervisor.ctl import Ctl
    done = []
    def on_request(peer, req):
        more = {"blob": "x" * 600_000} if mode == "ctl-exit" else {}  # over a socket's buffer
        peer.door.send(peer, protocol.ok(req.id, result(req, uid=peer.uid, peer_pid=peer.pid,
                                                        **more)))
        done.append(req.kind == "ack" and mode == "ctl-exit")
    ctl = Ctl(path, handover.listen(path), on_request)
    print("bound", flush=True)
    p = select.poll()
    p.register(ctl.fileno(), select.POLLIN)
    while not any(done):
        p.poll(1000)
        ctl.service()
        ctl.settle()
    ctl.close(unlink=True)  # as the supervisor's exit after ``ack``: the reply leaves first
    note("closed")
    sys.exit(0)

if mode == "door":  # a supervisor of 0.5.0 or 0.6.0: a door answering the DEALER's ZMTP
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)
    print("bound", flush=True)
    while True:
        conn, _ = srv.accept()
        note("connection")
        codec = zmtp.Codec()
        conn.sendall(codec.output())
        while data := conn.recv(1 << 16):
            codec.feed(data)
            out = codec.output()
            while (payload := codec.next()) is not None:
                req = protocol.decode_request(payload)
                out += codec.frame(protocol.encode_reply(protocol.ok(req.id, result(req))))
            out += codec.output()
            if out:
                conn.sendall(out)
        conn.close()

# a libzmq ROUTER: supervisors of 0.2.0 to 0.4.0 (and 0.1.0, at sock)
if mode == "late":  # one that binds only after a while
    time.sleep(float(sys.argv[4]))
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.bind("ipc://" + path)
print("bound", flush=True)
while True:
    ident, data = s.recv_multipart()
    req = protocol.decode_request(data)
    if mode == "mute":  # takes requests, never answers
        note(f"request {req.kind} {req.id}")
        continue
    if mode == "busy":  # a refusal that names no request
        note(f"request {req.kind} {req.id}")
        go()
        s.send_multipart([ident, protocol.encode_reply(protocol.error(None, Busy("busy")))])
        continue
    s.send_multipart([ident, protocol.encode_reply(protocol.ok(req.id, result(req)))])
"""


class Loop:
    """The agent's loop in miniature: one poller, the timers, one link."""

    def __init__(self, path: str) -> None:
        self.poller = Poller()
        self.timers = Timers()
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.link = Link(self.ctx, self.timers, 1, 1, path)
        self.poller.register(self.link.sock)

        def reopened(old: Any, new: Any) -> None:
            self.poller.unregister(old)
            self.poller.register(new)
        self.link.on_reopen = reopened
        self.link.on_sent = self.poller.touched

    def call(self, kind: str, args: dict[str, Any] | None = None,
             timeout: float = 10.0) -> Callable[[], Any]:
        """Send a request; the returned function runs the loop until it is answered and
        gives the result (or raises the error)."""
        box: dict[str, Any] = {}
        self.link.request(kind, args or {}, timeout, lambda r: box.setdefault("ok", r),
                          lambda e: box.setdefault("err", e))

        def result() -> Any:
            self.run(lambda: bool(box), timeout + 5, f"the reply to {kind!r}")
            if "err" in box:
                raise box["err"]
            return box["ok"]
        return result

    def run(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            for item, _ in self.poller.poll(self.timers.timeout_ms(time.monotonic(), 50)):
                if item is self.link.sock:
                    self.link.readable()
            self.timers.run_due(time.monotonic())

    def __enter__(self) -> Loop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self.link.closed:
            self.poller.unregister(self.link.sock)
        self.link.close()
        self.poller.close()
        self.ctx.term()


@pytest.fixture
def scratch() -> Iterator[str]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="tl") as d:
        yield d


@pytest.fixture
def peers(scratch: str) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], str, str]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(mode: str, *extra: str, wait_bound: bool = True
              ) -> tuple[subprocess.Popen[bytes], str, str]:
        path, log = os.path.join(scratch, "sock"), os.path.join(scratch, "log")
        proc = subprocess.Popen([sys.executable, "-c", PEER, mode, path, log, *extra],
                                stdout=subprocess.PIPE)
        started.append(proc)
        if wait_bound:
            assert proc.stdout is not None and proc.stdout.readline() == b"bound\n"
        return proc, path, log
    yield start
    for proc in started:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def requests_seen(log: str) -> list[str]:
    with open(log) as f:
        return [line.split()[1] for line in f if line.startswith("request")]


def test_this_releases_router_answers_in_order_of_readiness_with_the_kernels_names(
        peers: Any) -> None:
    """supervisor/ctl.py against the link: pipelined requests each answered (the ROUTER's fd
    drained until Again), the agent's uid and pid from Peer-Address on the ROUTER's side and
    the supervisor's on the DEALER's."""
    proc, path, log = peers("ctl")
    with Loop(path) as loop:
        calls = [loop.call(kind) for kind in ("hello", "claim", "wait", "ack")]
        results = [c() for c in calls]
        assert [r["pong"] for r in results] == ["hello", "claim", "wait", "ack"]
        assert {(r["uid"], r["peer_pid"]) for r in results} == {(os.getuid(), os.getpid())}
        assert (loop.link.peer_pid, loop.link.peer_uid) == (proc.pid, os.getuid())
        assert requests_seen(log) == ["hello", "claim", "wait", "ack"]


def test_the_reply_to_ack_reaches_the_agent_although_the_supervisor_exits_at_once(
        peers: Any) -> None:
    """The supervisor closes its ROUTER right after its last reply (``ack``; a large one here,
    more than the socket's buffer takes at once): the close lingers until that reply has left
    (ctl.py), so the agent hears it whole; the process then exits."""
    proc, path, log = peers("ctl-exit")
    with Loop(path) as loop:
        reply = loop.call("ack")()
        assert reply["pong"] == "ack" and len(reply["blob"]) == 600_000
        assert proc.wait(timeout=10) == 0
        with open(log) as f:
            assert f.read().splitlines()[-1] == "closed"


def test_a_door_of_0_5_and_0_6_is_driven_through_its_zmtp(peers: Any) -> None:
    proc, path, log = peers("door")
    with Loop(path) as loop:
        first, second = loop.call("hello"), loop.call("wait")
        assert second() == {"pong": "wait", "pid": proc.pid}
        assert first()["pong"] == "hello"
        assert loop.link.peer_pid == proc.pid and loop.link.peer_uid == os.getuid()
        assert requests_seen(log) == ["hello", "wait"]


def test_a_router_before_0_5_is_driven_as_ever(peers: Any) -> None:
    proc, path, log = peers("router")
    with Loop(path) as loop:
        assert loop.call("hello")() == {"pong": "hello", "pid": proc.pid}
        assert loop.link.peer_pid == proc.pid  # Peer-Address
        assert loop.call("wait")()["pong"] == "wait"
        assert requests_seen(log) == ["hello", "wait"]


def test_a_peer_that_binds_late_gets_the_request_once_it_listens(peers: Any) -> None:
    proc, path, log = peers("late", "0.3", wait_bound=False)
    with Loop(path) as loop:
        assert loop.call("hello")()["pid"] == proc.pid
        assert requests_seen(log) == ["hello"]


def test_a_request_that_timed_out_is_never_delivered_to_a_successor(
        peers: Any, scratch: str) -> None:
    """Nobody listens: the request waits in the DEALER, times out, and the socket is replaced;
    a supervisor that binds the path afterwards gets only what was sent after."""
    path = os.path.join(scratch, "sock")
    with Loop(path) as loop:
        first = loop.link.sock
        lost = loop.call("terminate", timeout=0.3)
        with pytest.raises(TetherError, match="did not answer 'terminate' within 0.3s"):
            lost()
        assert loop.link.sock is not first and first.closed
        proc, _, log = peers("router")
        assert loop.call("wait")()["pid"] == proc.pid
        assert requests_seen(log) == ["wait"]


def _dropping(loop: Loop, seen: list[str], name: str) -> Callable[[TetherError], None]:
    """An error callback that, as the agent's ``trouble`` may (a supervisor found gone), drops
    the link: unregistered, then closed."""
    def on_err(exc: TetherError) -> None:
        seen.append(name)
        loop.poller.unregister(loop.link.sock)
        loop.link.close()
    return on_err


def test_a_callback_that_drops_the_link_on_an_id_less_error_ends_the_delivery(
        peers: Any) -> None:
    """An id-less error fails every request in flight; the first one's callback may drop the
    link (which forgets the rest): the delivery stops there, no error escapes the loop."""
    proc, path, log = peers("busy")
    with Loop(path) as loop:
        seen: list[str] = []
        for name in ("wait", "terminate"):
            loop.link.request(name, {}, 5.0, lambda r: seen.append("ok"),
                              _dropping(loop, seen, name))
        with open(log + ".go", "w"):
            pass
        loop.run(lambda: loop.link.closed, 5, "the refusal")
        assert seen == ["wait"]


def test_a_callback_that_drops_the_link_on_a_timeout_leaves_the_expired_one_told(
        peers: Any) -> None:
    """A timeout resets the link and fails the others first: one of them may drop the link;
    the request that timed out is still told, once, and no error escapes the timer."""
    proc, path, log = peers("mute")
    with Loop(path) as loop:
        seen: list[str] = []
        loop.link.request("terminate", {}, 0.2, lambda r: seen.append("ok"),
                          lambda e: seen.append(f"expired: {e.message}"))
        for name in ("wait", "claim"):
            loop.link.request(name, {}, 30.0, lambda r: seen.append("ok"),
                              _dropping(loop, seen, name))
        loop.run(lambda: len(seen) >= 2, 5, "the timeout")
        assert seen == ["wait", "expired: supervisor of job 1.1 did not answer 'terminate' "
                                "within 0.2s"]
        assert loop.link.closed and not loop.link.pending
