"""The agent's link to a supervisor (agent/link.py) against real peers in their own processes:
a door's native frames, a libzmq ROUTER (the supervisors before 0.5.0), a ROUTER that closes
before its greeting, a peer that binds late, one that reads late, and the agent's own poller."""

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

from tether.agent import link as link_mod
from tether.agent.link import Link
from tether.agent.poller import Poller
from tether.shared.errors import TetherError
from tether.shared.timers import Timers

PEER = r"""
import os, socket, sys, time
import msgpack, zmq
from tether.shared import framing, protocol, zmtp

mode, path, log = sys.argv[1], sys.argv[2], sys.argv[3]

def note(text):
    with open(log, "a") as f:
        f.write(text + "\n")

def answer(payload):
    req = protocol.decode_request(payload)
    note(f"request {req.kind} {req.id}")
    return protocol.encode_reply(protocol.ok(req.id, {"pong": req.kind, "pid": os.getpid()}))

if mode == "router":  # a supervisor of 0.2.0 to 0.4.0: a libzmq ROUTER
    ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.bind("ipc://" + path)
    print("bound", flush=True)
    while True:
        ident, data = s.recv_multipart()
        s.send_multipart([ident, answer(data)])

if mode == "busy":  # a door over its connection caps: one id-less error, then the close
    from tether.shared.errors import Busy
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)
    print("bound", flush=True)
    while True:
        conn, _ = srv.accept()
        note("connection")
        while not os.path.exists(log + ".go"):
            time.sleep(0.01)
        conn.sendall(framing.frame(protocol.encode_reply(protocol.error(None, Busy("busy")))))
        conn.close()

if mode == "late":  # a door that binds only after a while
    time.sleep(float(sys.argv[4]))
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(16)
print("bound", flush=True)
n = 0
while True:
    conn, _ = srv.accept()
    n += 1
    note(f"connection {n}")
    if mode in ("wordless-then-zmtp", "wordless-then-door", "wordless-then-busy") and n == 1:
        conn.recv(1 << 16)  # what a ROUTER does with a frame that is no greeting
        conn.close()
        continue
    if mode == "wordless-then-busy" and n == 2:  # then refuses the listening one, first
        from tether.shared.errors import Busy
        while not os.path.exists(log + ".go"):
            time.sleep(0.01)
        conn.sendall(framing.frame(protocol.encode_reply(protocol.error(None, Busy("busy")))))
        conn.close()
        continue
    if mode == "wordless-then-zmtp":
        codec = zmtp.Codec()
    else:
        codec = framing.Deframer()
    if mode == "slow-reader":
        while not os.path.exists(log + ".go"):
            time.sleep(0.01)
    conn.sendall(codec.output())
    while True:
        data = conn.recv(1 << 16)
        if not data:
            break
        codec.feed(data)
        out = codec.output()
        while True:
            payload = codec.next()
            if payload is None:
                break
            out += codec.frame(answer(payload))
        out += codec.output()
        if out:
            conn.sendall(out)
    conn.close()
"""


class Loop:
    """The agent's loop in miniature: one poller, the timers, one link."""

    def __init__(self, path: str) -> None:
        self.poller = Poller()
        self.timers = Timers()
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.link = Link(self.ctx, self.timers, 1, 1, path)
        if self.link.sock is not None:
            self.poller.register(self.link.sock)

        def reopened(old: Any, new: Any) -> None:
            if old is not None:
                self.poller.unregister(old)
            if new is not None:
                self.poller.register(new)
        self.link.on_reopen = reopened
        self.link.on_sent = self.poller.touched
        self.link.on_write = self.poller.want_write

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
        if self.link.sock is not None:
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


def connections(log: str) -> int:
    try:
        with open(log) as f:
            return sum(line.startswith("connection") for line in f)
    except FileNotFoundError:
        return 0


def test_a_door_is_spoken_to_natively_and_named_by_the_kernel(peers: Any) -> None:
    proc, path, log = peers("door")
    with Loop(path) as loop:
        assert loop.link.peer_pid == proc.pid and loop.link.peer_uid == os.getuid()
        first, second = loop.call("hello"), loop.call("wait")
        assert second() == {"pong": "wait", "pid": proc.pid}
        assert first()["pong"] == "hello"
        assert not loop.link.legacy
        assert requests_seen(log) == ["hello", "wait"]


def test_a_router_before_0_5_gets_its_requests_through_a_dealer(peers: Any) -> None:
    proc, path, log = peers("router")
    with Loop(path) as loop:
        assert loop.call("hello")() == {"pong": "hello", "pid": proc.pid}
        assert loop.link.legacy and isinstance(loop.link.sock, zmq.Socket)
        assert loop.link.peer_pid == proc.pid  # Peer-Address, as before
        assert loop.call("wait")()["pong"] == "wait"
        assert requests_seen(log) == ["hello", "wait"]


def test_a_router_closing_before_its_greeting_is_found_by_listening_first(
        peers: Any) -> None:
    """libzmq may read our frame and drop the connection before it sends its greeting: the
    link's next connection listens first, hears ZMTP, and the request goes again, once."""
    proc, path, log = peers("wordless-then-zmtp")
    with Loop(path) as loop:
        assert loop.call("claim")() == {"pong": "claim", "pid": proc.pid}
        assert loop.link.legacy
        assert requests_seen(log) == ["claim"]


def test_a_door_that_closed_a_connection_wordlessly_is_not_sent_the_request_again(
        peers: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same close from a door (one re-executing, say) may have followed the request's
    work: the request waits for its deadline, as on a DEALER; later ones go natively."""
    monkeypatch.setattr(link_mod, "PROBE", 0.05)
    proc, path, log = peers("wordless-then-door")
    with Loop(path) as loop:
        lost = loop.call("terminate", timeout=1.0)
        loop.run(lambda: connections(log) == 2 and loop.link.probe is None, 5,
                 "a second connection, listening first, to give up")
        assert loop.call("wait")()["pong"] == "wait"
        with pytest.raises(TetherError, match="did not answer 'terminate' within 1s"):
            lost()
        assert not loop.link.legacy
        assert requests_seen(log) == ["wait"]  # the first connection read and dropped it


def test_a_peer_that_binds_late_gets_the_request_once_it_listens(peers: Any) -> None:
    proc, path, log = peers("late", "0.3", wait_bound=False)
    with Loop(path) as loop:
        assert loop.link.sock is None  # nobody listened yet
        assert loop.call("hello")()["pid"] == proc.pid
        assert requests_seen(log) == ["hello"]


def test_a_request_larger_than_the_socket_buffer_never_blocks_the_loop(peers: Any) -> None:
    proc, path, log = peers("slow-reader")
    with Loop(path) as loop:
        big = {"blob": "x" * 900_000}
        t0 = time.monotonic()
        result = loop.call("inspect", big)
        assert time.monotonic() - t0 < 0.5, "the send waited for the peer"
        assert loop.link.sock is not None and loop.link.sock.wants_write  # type: ignore[union-attr]
        with open(log + ".go", "w"):
            pass
        assert result()["pong"] == "inspect"
        assert requests_seen(log) == ["inspect"]


def _dropping(loop: Loop, seen: list[str], name: str) -> Callable[[TetherError], None]:
    """An error callback that, as the agent's ``trouble`` may (a supervisor found gone), drops
    the link: unregistered, then closed."""
    def on_err(exc: TetherError) -> None:
        seen.append(name)
        if loop.link.sock is not None:
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
    proc, path, log = peers("slow-reader")
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


def test_a_refusal_heard_while_listening_first_fails_what_waits_and_sends_nothing_after(
        peers: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A door may speak first on the listening connection (its refusal, then its close): what
    waited fails with that refusal, nothing is written into the closing connection or sent
    twice later, and the next request goes out on a fresh connection."""
    monkeypatch.setattr(link_mod, "PROBE", 30.0)  # the refusal, not the timer, ends it
    proc, path, log = peers("wordless-then-busy")
    with Loop(path) as loop:
        first = loop.call("terminate", timeout=20.0)
        loop.run(lambda: loop.link.probe is not None, 5, "the listening connection")
        second = loop.call("wait", timeout=20.0)
        with open(log + ".go", "w"):
            pass
        for result in (first, second):
            with pytest.raises(TetherError, match="busy"):
                result()
        assert loop.call("claim")()["pong"] == "claim"
        assert requests_seen(log) == ["claim"] and connections(log) == 3
