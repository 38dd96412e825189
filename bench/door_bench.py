"""What one untrusted user can make each daemon hold before its door refuses or stops reading.

    .venv/bin/python bench/door_bench.py [--json]        (as root: the probe runs as nobody)

For the agent's door and a running job's supervisor's door, as user ``nobody``:

1. connections: 200 opened at once; how many the door keeps (the rest get one ``busy`` frame
   and are closed);
2. unread reply bytes: requests whose error replies echo 500 KB each, sent on one connection
   (then on 8) without reading a byte, until the door stops reading for 2 s; then every reply
   is read: the bytes that arrive are what the daemon queued (plus the kernel's socket buffer),
   and the daemon's RSS growth meanwhile.

Starts its own agent on a temporary state directory and kills everything it started.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import ScratchAgent  # noqa: E402
from tether.shared.client import Client  # noqa: E402

PROBE = r'''
import json, os, select, socket, struct, sys, time
import msgpack
path = sys.argv[1]

def frame(b):
    return struct.pack(">I", len(b)) + b

def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0

held = []
for _ in range(200):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    held.append(s)
time.sleep(0.5)
kept = 0
for s in held:
    r, _, _ = select.select([s], [], [], 0)
    if not r:
        kept += 1
    s.close()
out = {"connections_kept": kept, "connections_refused": 200 - kept}
body = frame(msgpack.packb({"v": 1, "id": 1, "kind": "state", "args": {},
                            "Y" * 500_000: 1}))
pid = int(sys.argv[2])
for conns in (1, 8):
    socks = [socket.socket(socket.AF_UNIX) for _ in range(conns)]
    for s in socks:
        s.connect(path)
        s.setblocking(False)
    before = rss(pid)
    pending = {s: memoryview(body) for s in socks}
    sent, stalled = 0, time.monotonic()
    while time.monotonic() - stalled < 2.0:
        progress = False
        for s in socks:
            try:
                n = s.send(pending[s])
            except BlockingIOError:
                continue
            progress = True
            pending[s] = pending[s][n:]
            if not pending[s]:
                sent += 1
                pending[s] = memoryview(body)
        if progress:
            stalled = time.monotonic()
        else:
            time.sleep(0.01)
    grown = rss(pid) - before
    got = 0
    for s in socks:
        s.setblocking(True)
        s.settimeout(0.5)
        try:
            while True:
                data = s.recv(1 << 20)
                if not data:
                    break
                got += len(data)
        except (TimeoutError, OSError):
            pass
        s.close()
    out[f"unread_bytes_{conns}_conn"] = got
    out[f"requests_sent_{conns}_conn"] = sent
    out[f"rss_growth_kb_{conns}_conn"] = grown
print(json.dumps(out))
'''


def probe(path: str, pid: int) -> dict[str, int]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", PROBE, path, str(pid)], user="nobody",
                         group="nogroup", extra_groups=[], capture_output=True, text=True,
                         cwd="/", env={"PATH": "/usr/bin:/bin", "PYTHONPATH": root},
                         timeout=120)
    if res.returncode != 0:
        raise SystemExit(f"the probe failed: {res.stderr.strip()}")
    out: dict[str, int] = json.loads(res.stdout)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    node = ScratchAgent("tdb", cpus=2)
    os.chmod(node.base, 0o755)
    try:
        agent_sock = os.path.join(node.state, "agent.sock")
        with Client(agent_sock, timeout=20) as c:
            job = c.call("submit", {"command": ["sleep", "600"], "workdir": node.work,
                                    "env": {"PATH": "/usr/bin:/bin"}})["id"]
            deadline = time.monotonic() + 60
            while (st := c.call("show", {"job": job}))["state"] != "running":
                if time.monotonic() > deadline:
                    raise SystemExit("the job did not start")
                time.sleep(0.05)
        result = {"agent": probe(agent_sock, node.proc.pid),
                  "supervisor": probe(os.path.join(node.state, "run", f"{job}.1", "sock"),
                                      int(st["supervisor_pid"])),
                  "load": os.getloadavg()[0]}
    finally:
        node.close()
    if ns.json:
        print(json.dumps(result))
        return 0
    print(f"what user nobody can make a daemon hold (load {result['load']:.2f})")
    for name in ("agent", "supervisor"):
        r = result[name]
        print(f"  {name}: keeps {r['connections_kept']} of 200 connections "
              f"({r['connections_refused']} refused); unread replies held: "
              f"{r['unread_bytes_1_conn'] / 2**20:.1f} MiB on one connection "
              f"(RSS +{r['rss_growth_kb_1_conn'] // 1024} MiB), "
              f"{r['unread_bytes_8_conn'] / 2**20:.1f} MiB on 8 "
              f"(RSS +{r['rss_growth_kb_8_conn'] // 1024} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
