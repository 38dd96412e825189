"""Memory per idle step: what each of the template's optional memory mechanisms saves.

    .venv/bin/python bench/memory_bench.py                        # every variant, 30 steps, 60 s
    .venv/bin/python bench/memory_bench.py --steps 50 --idle 90 --only plain --only ksm

For each variant, one after the other on a fresh agent (its own state directory, so its own
template): ``--steps`` ``sleep 3600`` jobs started at once, left idle for ``--idle`` seconds,
then every supervisor weighed from ``/proc/PID/smaps_rollup`` (PSS, and USS = private clean +
dirty) and the template too; the agent, its template and every supervisor are killed before the
next variant starts. The same number of steps in every variant: PSS divides each shared page
among its sharers, so it is compared at equal counts only. Variants:

- ``plain``: the template as it is, no ``--ksm``;
- ``ksm``: ``agent --ksm``: each supervisor marks its own copies mergeable (supervisor/ksm.py),
  and ksmd runs for the variant (``/sys/kernel/mm/ksm/run`` set to 1 if this is root, its value
  put back afterwards), at the speed the kernel has (``pages_to_scan``, ``sleep_millisecs``).

(Until issue 26 it also weighed ``heapfile`` and ``heapfile+ksm``: the template's heap as a
memfd, supervisor/heapfile.py, removed for saving 0.66-0.96 MiB an idle step on 3.11-3.14;
bench/README.md, "Public mechanisms only".)

``saves`` is each variant's median PSS below ``plain``'s of the same run. Progress on stderr;
the table (and ``--json``: one object) on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench import (  # noqa: E402
    _title,
    ksm_counters,
    ksmd_on,
    ksmd_restore,
    supervisors_of,
    wait_template,
)
from bench.harness import (  # noqa: E402
    Agent,
    BenchError,
    Cleaner,
    become_subreaper,
    cpu_load,
    descendants_of_me,
    log,
    mem_of,
    poll_until,
)
from tether.shared.client import TetherError  # noqa: E402

#: name -> (more agent options, the agent's environment's additions, ksmd wanted)
VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, str], bool]] = {
    "plain": ((), {}, False),
    "ksm": (("--ksm",), {}, True),
}


def weigh(root: str, name: str, steps: int, idle: float) -> dict[str, Any]:
    extra, env, want_ksmd = VARIANTS[name]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the agent inherits it, and its template
    ksm_before = ksmd_on() if want_ksmd else None
    agent = Agent(root, name.replace("+", "_"), steps + 8, extra)
    try:
        agent.wait_serving(agent.start())
        wait_template(agent)
        ids = [agent.submit(["sleep", "3600"]) for _ in range(steps)]
        poll_until(lambda: agent.call("status")["jobs"].get("running", 0) == steps, 300,
                   f"{name}: all {steps} jobs running", interval=0.02)
        log(f"{name}: {steps} steps running; idling {idle:g} s")
        time.sleep(idle)
        sups = supervisors_of(agent, ids)
        mems = [mem_of(p) for p in sups.values()]
        for m in mems:
            m["Uss"] = m.get("Private_Clean", 0) + m.get("Private_Dirty", 0)
        template = [p for p in descendants_of_me() if _title(p).startswith("tether-template")
                    and agent.dir in _cmdline(p)]
        tmem = mem_of(template[0]) if template else {}
        out: dict[str, Any] = {
            "steps": steps, "idle_s": idle,
            "pss_kib": statistics.median(m["Pss"] for m in mems),
            "uss_kib": statistics.median(m["Uss"] for m in mems),
            "pss_min_max_kib": [min(m["Pss"] for m in mems), max(m["Pss"] for m in mems)],
            "template_pss_kib": tmem.get("Pss"),
        }
        if want_ksmd:
            out["ksm"] = ksm_counters()
        log(f"{name}: PSS {out['pss_kib'] / 1024:.2f} MiB, USS {out['uss_kib'] / 1024:.2f} MiB")
        return out
    finally:
        agent.kill()
        ksmd_restore(ksm_before)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def table(results: dict[str, dict[str, Any]]) -> str:
    base = results.get("plain", {}).get("pss_kib")
    lines = ["| variant | PSS per idle step (median) | USS | saves vs plain | template PSS |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | |")
            continue
        saves = f"{(base - r['pss_kib']) / 1024:.2f} MiB" if base is not None else "-"
        tpl = r.get("template_pss_kib")
        tpl_text = f"{tpl / 1024:.1f} MiB" if tpl else "-"
        lines.append(f"| {name} | {r['pss_kib'] / 1024:.2f} MiB | {r['uss_kib'] / 1024:.2f} MiB "
                     f"| {saves} | {tpl_text} |")
    return "\n".join(lines)


def _on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="idle steps per variant (30)")
    p.add_argument("--idle", type=float, default=60.0, help="seconds before weighing (60)")
    p.add_argument("--only", choices=list(VARIANTS), action="append",
                   help="only these variants (plain is always run first: the reference)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    ns = p.parse_args(argv)
    names = ["plain", *[n for n in (ns.only or VARIANTS) if n != "plain"]]
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    become_subreaper()
    root = tempfile.mkdtemp(dir="/tmp", prefix="tm")
    cleaner = Cleaner(root)
    head = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "python": f"{sys.executable} ({platform.python_version()})",
            "kernel": platform.release(), "load_start": cpu_load()}
    results: dict[str, dict[str, Any]] = {}
    rc = 0
    try:
        for name in names:
            try:
                results[name] = weigh(root, name, ns.steps, ns.idle)
            except (BenchError, TetherError, OSError) as exc:
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
                rc = 1
            cleaner.run()  # this variant's supervisors and template go before the next
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGHUP, signal.SIGINT})
        cleaner.run()
        left = [pid for pid in descendants_of_me() if alive_pid(pid)]
        head["cleanup"] = f"removed {root}; still alive: {left or 'none'}"
        log(head["cleanup"])
    head["load_end"] = cpu_load()
    if ns.json:
        print(json.dumps({**head, "variants": results}, indent=2))
    else:
        print(f"{head['date']}, {head['python']}, kernel {head['kernel']}, load "
              f"{head['load_start']} -> {head['load_end']}; {ns.steps} steps idle "
              f"{ns.idle:g} s per variant")
        print(table(results))
    return rc


def alive_pid(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


if __name__ == "__main__":
    sys.exit(main())
