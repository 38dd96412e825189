"""Round-trip latency of a supervisor's ``state`` verb.

    .venv/bin/python bench/rtt_bench.py [--calls 10000] [--jobs 50] [--json]

1. One client, one supervisor: ``--calls`` sequential ``state`` calls (after 1000 warm-up).
2. ``--jobs`` supervisors queried in parallel from one process: one DEALER per supervisor,
   one request in flight on each, the next sent as soon as its reply lands, ``--calls`` replies
   in all.
Starts its own agent on a temporary state directory and kills everything it started.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import zmq

from tether.shared import protocol
from tether.shared.client import Client, configure

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import ScratchAgent  # noqa: E402


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(us: list[float]) -> dict[str, float]:
    return {"median_us": round(statistics.median(us), 1), "p99_us": round(pct(us, 0.99), 1),
            "max_us": round(max(us), 1), "n": len(us)}


def sequential(sock: str, calls: int) -> dict[str, float]:
    with Client(sock, timeout=5) as c:
        for _ in range(1000):
            c.call("state")
        out = []
        for _ in range(calls):
            t = time.perf_counter_ns()
            c.call("state")
            out.append((time.perf_counter_ns() - t) / 1000)
    return summary(out)


def parallel(socks: list[str], calls: int) -> dict[str, float]:
    ctx = zmq.Context.instance()
    poller = zmq.Poller()
    dealers: list[zmq.Socket[Any]] = []
    for path in socks:
        d = ctx.socket(zmq.DEALER)
        configure(d)
        d.connect("ipc://" + path)
        poller.register(d, zmq.POLLIN)
        dealers.append(d)
    sent: dict[int, int] = {}
    rid = 0
    out: list[float] = []

    def send(i: int) -> None:
        nonlocal rid
        rid += 1
        sent[i] = time.perf_counter_ns()
        dealers[i].send(protocol.encode_request(protocol.Request(id=rid, kind="state")))
    for i in range(len(dealers)):
        send(i)
    index = {d: i for i, d in enumerate(dealers)}
    t0 = time.perf_counter()
    while len(out) < calls:
        for sock, _ in poller.poll(5000) or []:
            i = index[sock]
            protocol.decode_reply(sock.recv()).unwrap()
            out.append((time.perf_counter_ns() - sent[i]) / 1000)
            send(i)
    wall = time.perf_counter() - t0
    for d in dealers:
        d.close(linger=0)
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
        result = {"sequential": sequential(socks[0], ns.calls),
                  "parallel": parallel(socks, ns.calls), "supervisors": ns.jobs,
                  "load": os.getloadavg()[0]}
    finally:
        node.close()
    if ns.json:
        print(json.dumps(result))
    else:
        s, p = result["sequential"], result["parallel"]
        print(f"state round trip, {ns.calls} calls, load {result['load']:.2f}")
        print(f"  one client, one supervisor: median {s['median_us']} us, p99 {s['p99_us']} us")
        print(f"  {ns.jobs} supervisors in parallel: median {p['median_us']} us, "
              f"p99 {p['p99_us']} us (one request in flight per supervisor: "
              f"{p['calls_per_s']} calls/s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
