"""The agent's metrics for Prometheus (issue 28, point 6): a node_exporter textfile written
atomically every --metrics-interval, read here by prometheus_client's own parser (what
Prometheus accepts), with the node's and each running job's figures."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import Node, poll_until

#: a job that holds ~60 MB and burns CPU until told to stop
HOG = """
import os, sys
block = bytearray(60 * 1024 * 1024)
for i in range(0, len(block), 4096):
    block[i] = 1
while not os.path.exists(sys.argv[1]):
    pass
"""


def read(path: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The file's samples by metric name (a missing file: none), as Prometheus parses it."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return {}
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def one(samples: dict[str, Any], metric: str, **labels: str) -> float:
    found = [v for lab, v in samples.get(metric, []) if all(lab.get(k) == w for k, w in
                                                              labels.items())]
    assert len(found) == 1, (metric, labels, samples.get(metric))
    return float(found[0])


def test_the_metrics_file_parses_and_follows_the_node(node: Node) -> None:
    out = os.path.join(node.dir, "textfile")
    os.makedirs(out)
    path = os.path.join(out, "tether.prom")
    node.args += ["--metrics-file", path, "--metrics-interval", "0.2", "--memory-mb", "4096"]
    node.start()
    first = poll_until(lambda: read(path), 20, "the first metrics file")
    assert one(first, "tether_agent_up") == 1
    assert one(first, "tether_agent_starts_total") == 1
    assert one(first, "tether_cpus_total") == 4 and one(first, "tether_cpus_allocated") == 0
    assert one(first, "tether_memory_total_bytes") == 4096 * 2**20
    assert one(first, "tether_agent_info", node=node.status()["node"]) == 1

    stop = os.path.join(node.dir, "stop")
    name = 'hog "quoted" \\ back'  # label values escaped as the format says
    job = int(node.ok("submit", "-n", "1", "-c", "2", "--mem", "512M", "-J", name, "--",
                      sys.executable, "-c", HOG, stop).strip())
    node.wait_state(job, ("running",))
    cgroup = node.status()["cgroup"]["mode"] != "none"

    def busy() -> dict[str, Any] | None:
        s = read(path)
        if not s.get("tether_job_cpus"):
            return None
        if cgroup and not any(v >= 50 * 2**20 for _, v in s.get("tether_job_memory_bytes", [])):
            return None
        if cgroup and not any(v > 0.2 for _, v in s.get("tether_job_cpu_seconds_total", [])):
            return None
        return s
    s = poll_until(busy, 30, "the running job's figures")
    labels = {"job_id": str(job), "name": name, "user": node.job(job)["user"]}
    assert one(s, "tether_job_cpus", **labels) == 2
    assert one(s, "tether_job_memory_allocated_bytes", **labels) == 512 * 2**20
    assert one(s, "tether_jobs", state="running") == 1
    assert one(s, "tether_cpus_allocated") == 2
    assert one(s, "tether_memory_allocated_bytes") == 512 * 2**20
    assert one(s, "tether_queue_length") == 0
    if cgroup:
        assert one(s, "tether_job_memory_peak_bytes", **labels) >= 50 * 2**20
    # replaced whole each time: nothing but the file itself in node_exporter's directory
    assert os.listdir(out) == ["tether.prom"]

    # a clean stop leaves "down"; the next agent counts a restart and its reattach
    assert node.stop(signal.SIGTERM) == 0
    down = read(path)
    assert one(down, "tether_agent_up") == 0 and "tether_job_cpus" not in down
    node.start()
    # (the reattach time is left out until every supervisor found running has answered)
    again = poll_until(lambda: (s := read(path)) and one(s, "tether_agent_starts_total") == 2
                       and "tether_agent_reattach_seconds" in s and "tether_job_cpus" in s
                       and s, 20, "the restarted agent's file")
    assert one(again, "tether_agent_up") == 1
    assert one(again, "tether_agent_reattach_seconds") > 0  # the hog was running across it
    open(stop, "w").close()
    assert node.wait_end(job)["state"] == "completed"
    poll_until(lambda: one(read(path), "tether_jobs", state="completed") == 1, 20,
               "the ended job counted")
