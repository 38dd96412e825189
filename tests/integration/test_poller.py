"""The agent loop's epoll poller (agent/poller.py) with real ZeroMQ sockets, pipes and pidfds."""

from __future__ import annotations

import os
import select
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from tether.agent.poller import Poller


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    """A DEALER (as the agent's link) connected to a ROUTER (as a supervisor's ctl/ socket)."""
    ctx: zmq.Context[Any] = zmq.Context()
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        router = ctx.socket(zmq.ROUTER)
        router.bind(f"ipc://{d}/sock")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"ipc://{d}/sock")
        try:
            yield dealer, router
        finally:
            dealer.close(linger=0)
            router.close(linger=0)
            ctx.term()


def _reply_consumed(dealer: zmq.Socket[Any], router: zmq.Socket[Any]) -> None:
    """A request, its reply in the DEALER, and the reply's signal on ZMQ_FD already taken by
    someone processing the socket's commands (as a send may)."""
    # A socket signals a message only once a read found it empty (a reader waits): as the
    # poller's first look at a socket it registers does.
    assert not int(dealer.getsockopt(zmq.EVENTS)) & zmq.POLLIN
    dealer.send(b"request")
    ident, _ = router.recv_multipart()
    router.send_multipart([ident, b"reply"])
    fd = int(dealer.getsockopt(zmq.FD))
    assert select.select([fd], [], [], 10)[0] == [fd], "the reply never signalled"
    assert int(dealer.getsockopt(zmq.EVENTS)) & zmq.POLLIN  # commands processed: fd reset


def test_a_reply_whose_signal_a_send_took_is_still_reported(pair: Any) -> None:
    dealer, router = pair
    poller = Poller()
    try:
        poller.register(dealer, zmq.POLLIN)
        assert poller.poll(0) == []  # registered: asked once, nothing yet
        _reply_consumed(dealer, router)
        # the hazard: epoll on ZMQ_FD alone now waits for nothing
        ep = select.epoll()
        ep.register(int(dealer.getsockopt(zmq.FD)), select.EPOLLIN)
        assert ep.poll(0.2) == []
        ep.close()
        poller.touched(dealer)  # what the agent's link does after each send
        assert poller.poll(5000) == [(dealer, zmq.POLLIN)]
        assert dealer.recv(zmq.NOBLOCK) == b"reply"
        assert poller.poll(0) == []
    finally:
        poller.close()


def test_a_socket_registered_with_a_reply_waiting_is_reported(pair: Any) -> None:
    dealer, router = pair
    _reply_consumed(dealer, router)
    poller = Poller()
    try:
        poller.register(dealer, zmq.POLLIN)
        assert poller.poll(5000) == [(dealer, zmq.POLLIN)]
    finally:
        poller.close()


def test_replies_signalled_on_the_fd_wake_a_blocked_poll_once(pair: Any) -> None:
    dealer, router = pair
    poller = Poller()
    try:
        poller.register(dealer, zmq.POLLIN)
        assert poller.poll(0) == []
        for n in range(3):
            dealer.send(b"request %d" % n)
            poller.touched(dealer)
            assert poller.poll(0) == []  # no reply yet, and asking took nothing
            ident, _ = router.recv_multipart()
            router.send_multipart([ident, b"reply %d" % n])
            assert poller.poll(10_000) == [(dealer, zmq.POLLIN)]
            assert dealer.recv(zmq.NOBLOCK) == b"reply %d" % n
            with pytest.raises(zmq.Again):  # drained: the fd is armed for the next one
                dealer.recv(zmq.NOBLOCK)
        poller.unregister(dealer)
        dealer.send(b"late")
        ident, _ = router.recv_multipart()
        router.send_multipart([ident, b"unwatched"])
        assert poller.poll(200) == []
    finally:
        poller.close()


def test_plain_fds_pidfds_and_unregistering() -> None:
    poller = Poller()
    r, w = os.pipe()
    proc = subprocess.Popen(["sleep", "30"])
    pidfd = os.pidfd_open(proc.pid)
    try:
        poller.register(r, zmq.POLLIN)
        poller.register(pidfd, zmq.POLLIN)
        assert poller.poll(0) == []
        os.write(w, b"x")
        assert poller.poll(1000) == [(r, zmq.POLLIN)]
        assert poller.poll(0) == [(r, zmq.POLLIN)]  # level-triggered, as zmq.Poller
        os.read(r, 1)
        proc.kill()
        proc.wait()
        assert poller.poll(5000) == [(pidfd, zmq.POLLIN)]
        poller.unregister(pidfd)
        assert poller.poll(0) == []
        with pytest.raises(KeyError):
            poller.unregister(pidfd)
        os.close(w)  # EOF (hang-up) counts as input, as for zmq.Poller
        assert poller.poll(1000) == [(r, zmq.POLLIN)]
    finally:
        poller.close()
        os.close(pidfd)
        os.close(r)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_fd_closed_after_the_poll_is_stale_until_the_next_one() -> None:
    """The agent's loop skips an event whose fd an earlier handler of the same batch closed:
    its number may belong to something else by then (a supervisor's pidfd reopened on a
    spawn's pipe's number); what is ready under the number now comes with the next poll."""
    poller = Poller()
    r, w = os.pipe()
    try:
        poller.register(r, zmq.POLLIN)
        os.write(w, b"x")
        assert poller.poll(1000) == [(r, zmq.POLLIN)]
        assert not poller.stale(r)
        poller.unregister(r)
        os.close(r)
        os.close(w)
        old = r
        r, w = os.pipe()  # the lowest free numbers: most likely the same ones
        poller.register(r, zmq.POLLIN)
        assert poller.stale(old)
        assert poller.poll(0) == []  # the new pipe is empty: nothing of the old one is left
        assert not poller.stale(old)
    finally:
        poller.close()
        os.close(r)
        os.close(w)


def test_a_bounded_turn_leaves_the_rest_for_the_next_poll_and_loses_nothing() -> None:
    """``limit``: the urgent items and at most ``limit`` others a turn. A ZeroMQ socket left
    for later had its fd's signal spent by the look that found its reply: it must come back at
    the next poll all the same (a restart with 1,000 supervisors answering at once)."""
    ctx: zmq.Context[Any] = zmq.Context()
    poller = Poller()
    r, w = os.pipe()  # stands for the door: always first
    socks: list[zmq.Socket[Any]] = []
    try:
        with tempfile.TemporaryDirectory(dir="/tmp") as d:
            for i in range(10):
                router = ctx.socket(zmq.ROUTER)
                router.bind(f"ipc://{d}/s{i}")
                dealer = ctx.socket(zmq.DEALER)
                dealer.connect(f"ipc://{d}/s{i}")
                socks += [router, dealer]
                poller.register(dealer, zmq.POLLIN)
            assert poller.poll(0) == []  # registered: asked once, nothing yet
            dealers = socks[1::2]
            for router, dealer in zip(socks[0::2], dealers, strict=True):
                _reply_consumed(dealer, router)  # its signal taken by someone's look
                poller.touched(dealer)  # as the agent's link after its send
            os.write(w, b"x")
            poller.register(r, zmq.POLLIN)
            seen: list[Any] = []
            for turn in range(4):
                got = [item for item, _ in poller.poll(5000, 3, urgent=lambda i: i == r)]
                assert len(got) == (4 if turn < 3 else 2), (turn, got)
                assert r in got, "the urgent fd was held back"
                for item in got:
                    if item is not r:
                        assert item.recv(zmq.NOBLOCK) == b"reply"
                        seen.append(item)
                if turn == 2:
                    os.read(r, 1)
                    os.write(w, b"y")  # still ready: urgent again in the last turn
            assert sorted(map(id, seen)) == sorted(map(id, dealers)), "a reply was lost"
            os.read(r, 1)
            assert poller.poll(0) == []
    finally:
        poller.close()
        os.close(r)
        os.close(w)
        for s in socks:
            s.close(linger=0)
        ctx.term()
