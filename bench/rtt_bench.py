"""Round-trip latency of a supervisor's ``state`` verb through its door (what people use).

    .venv/bin/python bench/rtt_bench.py [--calls 10000] [--jobs 50] [--json]

1. One client, one supervisor: ``--calls`` sequential ``state`` calls (after 1000 warm-up),
   through the door (``shared.client.Client``: plain AF_UNIX, length-prefixed msgpack), and,
   as the reference measured in the same run, through the supervisor's ZeroMQ socket in ctl/
   (a DEALER, as agents before 0.5.0 talk to it; as root only).
2. ``--jobs`` supervisors queried in parallel from one process through their doors: one
   connection per supervisor, one request in flight on each, the next sent as soon as its
   reply lands, ``--calls`` replies in all.
3. The agent's ``status`` through its door, sequentially.
Starts its own agent on a temporary state directory and kills everything it started.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import sys
import time

from tether.shared import framing, protocol
from tether.shared.client import Client
from tether.shared.zmq_client import Client as ZmqClient

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import ScratchAgent  # noqa: E402


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(us: list[float]) -> dict[str, float]:
    return {"median_us": round(statistics.median(us), 1), "p99_us": round(pct(us, 0.99), 1),
            "max_us": round(max(us), 1), "n": len(us)}


def sequential(client: Client | ZmqClient, calls: int, kind: str = "state") -> dict[str, float]:
    with client as c:
        for _ in range(min(1000, calls)):
            c.call(kind)
        out = []
        for _ in range(calls):
            t = time.perf_counter_ns()
            c.call(kind)
            out.append((time.perf_counter_ns() - t) / 1000)
    return summary(out)


def parallel(socks: list[str], calls: int) -> dict[str, float]:
    poller = select.poll()
    conns: dict[int, tuple[socket.socket, framing.Deframer]] = {}
    for path in socks:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(path)
        conns[c.fileno()] = (c, framing.Deframer())
        poller.register(c, select.POLLIN)
    sent: dict[int, int] = {}
    rid = 0
    out: list[float] = []

    def send(fd: int) -> None:
        nonlocal rid
        rid += 1
        sent[fd] = time.perf_counter_ns()
        conns[fd][0].sendall(framing.frame(protocol.encode_request(
            protocol.Request(id=rid, kind="state"))))
    for fd in conns:
        send(fd)
    t0 = time.perf_counter()
    while len(out) < calls:
        for fd, _ in poller.poll(5000) or []:
            c, deframer = conns[fd]
            deframer.feed(c.recv(1 << 16))
            while (payload := deframer.next()) is not None:
                protocol.decode_reply(payload).unwrap()
                out.append((time.perf_counter_ns() - sent[fd]) / 1000)
                send(fd)
    wall = time.perf_counter() - t0
    for c, _ in conns.values():
        c.close()
    return dict(summary(out), calls_per_s=round(len(out) / wall))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    node = ScratchAgent("trt", cpus=ns.jobs + 4)
    state, work = node.state, node.work
    try:
        with Client(os.path.join(state, "agent.sock"), timeout=20) as agent_client:
            ids = [agent_client.call("submit", {"command": ["sleep", "600"], "workdir": work,
                                                "env": {"PATH": "/usr/bin:/bin"}})["id"]
                   for _ in range(ns.jobs)]
            deadline = time.monotonic() + 120
            while any(agent_client.call("show", {"job": i})["state"] != "running" for i in ids):
                if time.monotonic() > deadline:
                    raise SystemExit("jobs did not start")
                time.sleep(0.1)
        socks = [os.path.join(state, "run", f"{i}.1", "sock") for i in ids]
        ctl = os.path.join(state, "run", f"{ids[0]}.1", "ctl", "sock")
        result = {"sequential": sequential(Client(socks[0], timeout=5), ns.calls),
                  "zmq_reference": sequential(ZmqClient(ctl, timeout=5), ns.calls),
                  "parallel": parallel(socks, ns.calls), "supervisors": ns.jobs,
                  "agent_status": sequential(Client(os.path.join(state, "agent.sock"),
                                                    timeout=5), ns.calls // 5, "status"),
                  "load": os.getloadavg()[0]}
    finally:
        node.close()
    if ns.json:
        print(json.dumps(result))
    else:
        s, p, z = result["sequential"], result["parallel"], result["zmq_reference"]
        a = result["agent_status"]
        print(f"state round trip, {ns.calls} calls, load {result['load']:.2f}")
        print(f"  one client, one supervisor, door: median {s['median_us']} us, "
              f"p99 {s['p99_us']} us")
        print(f"  the same through its ZeroMQ socket (reference): median {z['median_us']} us, "
              f"p99 {z['p99_us']} us (door/zmq median ratio "
              f"{s['median_us'] / z['median_us']:.2f})")
        print(f"  agent status through its door: median {a['median_us']} us, "
              f"p99 {a['p99_us']} us")
        print(f"  {ns.jobs} supervisors in parallel: median {p['median_us']} us, "
              f"p99 {p['p99_us']} us (one request in flight per supervisor: "
              f"{p['calls_per_s']} calls/s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
