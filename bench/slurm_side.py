"""Slurm's side of the benchmark rows that have one, run in the same ``bench.py`` run as
tether's when Slurm is reachable (``SLURM_CONF`` set, ``srun`` on PATH): e.g. the throwaway
single-node Slurm of ``bench/slurm_local.py``. Apart from bench.py because none of it concerns
tether: submitting with sbatch, finding slurmstepd processes, cancelling what we submitted.

Every job is named ``tb<pid>`` (this run) with its output to /dev/null, and every function
cancels what it submitted and waits until slurmctld no longer lists it, also on an error,
so that the next part finds the node's CPUs free (``srun -n2`` would otherwise queue).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator
from typing import Any

from bench.harness import BenchError, all_pids, log, mem_of, poll_until, summary

NAME = f"tb{os.getpid()}"


def available() -> bool:
    return bool(os.environ.get("SLURM_CONF")) and all(
        shutil.which(t) for t in ("srun", "sbatch", "squeue", "scancel", "scontrol"))


def _run(argv: list[str], timeout: float = 60) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise BenchError(f"{' '.join(argv)} exited {res.returncode}: {res.stderr[-500:]}")
    return res.stdout


def sbatch(*args: str) -> int:
    return int(_run(["sbatch", "--parsable", "-J", NAME, "-o", "/dev/null", *args])
               .split(";")[0])


def states() -> dict[int, str]:
    """This run's jobs that slurmctld still lists (pending, running, completing)."""
    out = _run(["squeue", "-h", "-n", NAME, "-o", "%i %T"])
    return {int(i): s for i, s in (line.split() for line in out.splitlines())}


def cancel_all() -> None:
    subprocess.run(["scancel", "-n", NAME], capture_output=True, timeout=60)
    poll_until(lambda: not states(), 60, f"Slurm jobs named {NAME} to end", interval=0.1)


@contextlib.contextmanager
def cancelled_after() -> Iterator[None]:
    try:
        yield
    finally:
        cancel_all()


def stepds(job: int) -> dict[str, int]:
    """The slurmstepd processes of ``job``: {step (``0``, ``batch``...): pid}, from their
    process titles (``slurmstepd: [JOB.STEP]``)."""
    pat = re.compile(rb"slurmstepd: \[" + str(job).encode() + rb"\.(\w+)\]")
    out = {}
    for pid in all_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                m = pat.match(f.read())
        except OSError:
            continue
        if m:
            out[m.group(1).decode()] = pid
    return out


@contextlib.contextmanager
def running_step() -> Iterator[int]:
    """A batch job whose step 0 is an ``srun sleep``, running; yields the job id."""
    with cancelled_after():
        job = sbatch("--wrap", "srun sleep 3600")
        poll_until(lambda: "0" in stepds(job), 60, f"Slurm job {job}'s step 0 running")
        yield job


def throughput(jobs: int) -> dict[str, Any]:
    """``jobs`` ``sbatch --wrap true`` back to back, first submit to the last job no longer
    listed by slurmctld (completed, epilog done)."""
    log(f"throughput: {jobs} `sbatch --wrap true` back to back (Slurm)")
    replies: list[float] = []
    with cancelled_after():
        t0 = time.perf_counter()
        for _ in range(jobs):
            t = time.perf_counter()
            sbatch("--wrap", "true")
            replies.append((time.perf_counter() - t) * 1000)
        t_submitted = time.perf_counter()
        poll_until(lambda: not states(), 600 + jobs * 10, f"{jobs} sbatch jobs to end",
                   interval=0.05)
        total = time.perf_counter() - t0
    return {"jobs": jobs, "total_s": round(total, 2), "jobs_per_s": round(jobs / total, 2),
            "submit_all_s": round(t_submitted - t0, 2), "submit_reply_ms": summary(replies, 2)}


def steps(n: int, idle: float) -> dict[str, Any]:
    """``n`` concurrent ``sleep`` steps of one batch job (``srun --overlap``: they share its
    CPU), each with its slurmstepd; after ``idle`` seconds every step's slurmstepd is weighed
    from /proc/PID/smaps_rollup (the batch step's and the srun clients are not counted)."""
    log(f"steps: {n} `srun --overlap sleep` steps of one Slurm job")
    with cancelled_after():
        job = sbatch("--wrap", f"for i in $(seq {n}); do srun --overlap -n1 sleep 3600 & "
                     "done; wait")
        t0 = time.perf_counter()
        poll_until(lambda: sum(s.isdigit() for s in stepds(job)) >= n, 600,
                   f"{n} steps of Slurm job {job} running", interval=0.1)
        all_running = time.perf_counter() - t0
        log(f"steps: {n} Slurm steps running after {all_running:.1f} s; idling {idle:g} s")
        time.sleep(idle)
        mems = [mem_of(pid) for step, pid in stepds(job).items() if step.isdigit()]
    if len(mems) < n:
        raise BenchError(f"only {len(mems)} of {n} Slurm steps were still running at the end")
    return {"steps": n, "all_running_s": round(all_running, 2), "idle_s": idle,
            "slurmstepd_median": {k: statistics.median(m[k] for m in mems)
                                  for k in ("Pss", "Pss_Anon", "Pss_File", "VmRSS", "Threads",
                                            "fds")},
            "slurmstepd_pss_sum_mib": round(sum(m["Pss"] for m in mems) / 1024, 1)}
