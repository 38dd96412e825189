"""The benchmark's readable report: issue 10's table first, then the details of each part."""

from __future__ import annotations

from typing import Any


def fmt(s: dict[str, Any] | None, unit: str = "ms") -> str:
    if not s or not s.get("n"):
        return "-"
    return (f"median {s['median']} {unit}, p90 {s['p90']} (min {s['min']}, max {s['max']}, "
            f"n={s['n']})")


def med(s: dict[str, Any] | None, unit: str = "ms") -> str:
    return f"{s['median']} {unit}" if s and s.get("n") else "-"


def xpy(part: dict[str, Any] | None, key: str) -> str:
    return f"{part[key]['x_python']}x py" if part and key in part else "-"


def vs(ours: float, theirs: float | None, what: str) -> str:
    """`` (0.52x srun)``: tether's figure as a multiple of Slurm's, when Slurm was measured."""
    return f" ({ours / theirs:.2f}x {what})" if theirs else ""


def _per_python(tp: dict[str, Any]) -> str:
    """Throughput against the machine: jobs in one interpreter start's time (the goal, 100
    jobs/s where `python -I -c pass` took the issue's 11 ms, is 1.10)."""
    if "jobs_per_python" not in tp:
        return f"submit reply {med(tp['submit_reply_ms'])}"
    return (f"{tp['jobs_per_python']} jobs per python ({tp['python_ms']} ms; goal at 11 ms: "
            f"1.10); submit reply {med(tp['submit_reply_ms'])}")


def table(r: dict[str, Any]) -> list[str]:
    """One line per row of the issue's table: Slurm (when measured), tether, goal, reference."""
    rows: list[tuple[str, str, str, str, str]] = []
    cli = r.get("cli")
    if cli:
        rows.append(("submit --wait -- true vs srun -N1 -n1 true", med(cli.get("srun")),
                     med(cli["tether"]) + vs(cli["tether"]["median"],
                                             cli.get("srun", {}).get("median"), "srun"),
                     "<= 45 ms", f"{xpy(cli, 'tether')}; python {med(cli['python'])}"))
    sp = r.get("spawn")
    if sp:
        rows.append(("supervisor: spawn -> ready", "-",
                     f"warm {med(sp['warm'])}, cold {med(sp['cold'])}", "<= 10 ms",
                     f"warm {xpy(sp, 'warm')}, cold {xpy(sp, 'cold')}"))
    st = r.get("steps")
    if st:
        m = st["supervisor_median"]
        sl = st.get("slurm")
        sl_pss = sl["slurmstepd_median"]["Pss"] if sl else 0
        rows.append((f"memory per idle step, {st['steps']} concurrent (PSS, after "
                     f"{st['idle_s']:g} s{', --ksm' if st.get('ksm') is not None else ''})",
                     f"slurmstepd {sl_pss / 1024:.2f} MiB" if sl else "-",
                     f"{m['Pss'] / 1024:.2f} MiB (USS {m['Uss'] / 1024:.2f})"
                     + vs(m["Pss"], sl_pss, "slurmstepd"), "<= 3 MiB", ""))
        rows.append((f"steps that fit in {st['mem_total_mib'] / 1024:.1f} GiB",
                     f"{int(st['mem_total_mib'] * 1024 / sl_pss):,}" if sl else "-",
                     f"{st['steps_that_fit']:,}", ">= 6,000", "MemTotal / median PSS"))
        if "restart_median_log_ms" in st:
            rows.append((f"agent restart -> answering, {st['steps']} live supervisors", "-",
                         f"{st['restart_median_log_ms']} ms in the agent "
                         f"({st['restart_median_status_ms']} ms Popen -> status)",
                         "<= 60 ms @100, <= 400 ms @1,000",
                         f"{st['restart_median_log_ms'] / st['steps']:.2f} ms per step, "
                         "fixed costs included"))
        rows.append((f"status while {st['steps']} steps are submitted and start", "-",
                     med(st["status_while_starting_ms"]) + f", max "
                     f"{st['status_while_starting_ms'].get('max')} ms", "< 50 ms (issue 8)",
                     ""))
    ins = r.get("inspect")
    if ins:
        rows.append(("inspect JOB --json vs scontrol listpids", med(ins.get("scontrol")),
                     med(ins["tether"]) + vs(ins["tether"]["median"],
                                             ins.get("scontrol", {}).get("median"), "scontrol"),
                     "<= 25 ms",
                     f"{xpy(ins, 'tether')}; python {med(ins['python'])}"))
    tp = r.get("throughput")
    if tp:
        sb = tp.get("sbatch")
        rows.append((f"{tp['jobs']} true jobs back to back, in-process",
                     f"sbatch {sb['jobs_per_s']} jobs/s" if sb else "-",
                     f"{tp['jobs_per_s']} jobs/s"
                     + vs(tp["jobs_per_s"], sb["jobs_per_s"] if sb else None, "sbatch"),
                     ">= 100 jobs/s", _per_python(tp)))
    tc = r.get("throughput_concurrent")
    if tc:
        rows.append((f"the same from {tc['submitters']} concurrent clients", "-",
                     f"{tc['jobs_per_s']} jobs/s", ">= 100 jobs/s", _per_python(tc)))
    tb = r.get("throughput_busy")
    if tb:
        rows.append((f"the same, one client, {tb['busy']} steps running", "-",
                     f"{tb['jobs_per_s']} jobs/s", "",
                     f"agent CPU {tb.get('agent_cpu_ms_per_job')} ms per job"))
    mpi = r.get("mpi")
    if mpi and "tether" in mpi:
        rows.append(("MPICH 2-rank hello vs mpiexec -n 2", med(mpi.get("srun")),
                     f"{med(mpi['tether'])} ({mpi['x_mpiexec']}x mpiexec "
                     f"{med(mpi['mpiexec'])})" + vs(mpi["tether"]["median"],
                                                    mpi.get("srun", {}).get("median"), "srun"),
                     "<= 1.3x mpiexec", xpy(mpi, "tether")))
        if "mpiexec_xml" in mpi:
            rows.append(("the same, mpiexec given tether's hwloc XML", "-",
                         f"{mpi['x_mpiexec_xml']}x mpiexec {med(mpi['mpiexec_xml'])}", "",
                         "what the ranks' loading the node's topology is worth"))
    out = ["| figure | Slurm | tether | goal | reference |", "|---|---|---|---|---|"]
    out += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    return out


def report(r: dict[str, Any]) -> str:
    out = [
        "tether benchmark (issue 10)",
        f"  {r['date']}, {r['host']}, {r['cpus']} CPUs, python {r['python']}",
        f"  load average at start {r['load_start']}, at end {r.get('load_end')}; "
        f"Slurm measured: {'yes' if r['slurm'] else 'no (SLURM_CONF unset or no srun)'}",
        f"  total {r.get('total_s')} s",
        "",
        *table(r),
    ]
    cli = r.get("cli")
    if cli:
        out += ["", f"cli ({cli['argv0']}):"]
        out += [f"  {k:<10} {fmt(cli[k])}" for k in ("tether", "in_process", "srun", "python")
                if k in cli]
        if "cli_own_ms" in cli:
            out.append(f"  the CLI's own part (tether - in_process, medians of the same rounds): "
                       f"{cli['cli_own_ms']} ms")
    sp = r.get("spawn")
    if sp:
        out += ["", "spawn -> ready (socket bound), no agent:"]
        out += [f"  {k:<8} {fmt(sp[k])}" for k in ("warm", "cold", "python")]
    la = r.get("launch")
    if la:
        out += ["", f"launch, in-process client ({la['warm_starts']} warm starts):",
                f"  submit reply          {fmt(la['submit_reply_ms'])}",
                f"  submit -> running     {fmt(la['submit_to_running_ms'])}",
                f"    spawned -> ready    {fmt(la['spawned_to_ready_ms'])}",
                f"    ready -> launched   {fmt(la['ready_to_launched_ms'])} (hello + claim)",
                f"  submit -> completed   {fmt(la['submit_to_completed_ms'])} "
                f"({la.get('x_python')}x python)",
                f"    launched -> ended   {fmt(la.get('launched_to_ended_ms', {}))} "
                "(the task, reaping, the exit record)",
                f"  python -I -c pass     {fmt(la.get('python_ms', {}))}"]
    ins = r.get("inspect")
    if ins:
        out += ["", "inspect --json:"]
        out += [f"  {k:<8} {fmt(ins[k])}" for k in ("tether", "scontrol", "python") if k in ins]
    for key in ("throughput", "throughput_concurrent", "throughput_busy"):
        tp = r.get(key)
        if tp:
            busy = f", {tp['busy']} steps running" if tp.get("busy") else ""
            out += ["", f"{key}: {tp['jobs']} jobs from {tp.get('submitters', 1)} client(s)"
                    f"{busy} "
                    f"in {tp['total_s']} s ({tp['jobs_per_s']}/s); submits took "
                    f"{tp['submit_all_s']} s, each reply {fmt(tp['submit_reply_ms'])}; "
                    f"agent database fsyncs per job: {tp.get('db_syncs_per_job')}, agent CPU "
                    f"per job: {tp.get('agent_cpu_ms_per_job')} ms, CPU of all processes per "
                    f"job: {tp.get('all_cpu_ms_per_job')} ms; python -I -c pass just before "
                    f"{tp.get('python_ms')} ms ({tp.get('jobs_per_python')} jobs per python)"]
            sb = tp.get("sbatch")
            if sb:
                out.append(f"  Slurm: {sb['jobs']} sbatch --wrap true in {sb['total_s']} s "
                           f"({sb['jobs_per_s']}/s); submits took {sb['submit_all_s']} s, each "
                           f"sbatch {fmt(sb['submit_reply_ms'])}")
    st = r.get("steps")
    if st:
        m = st["supervisor_median"]
        out += ["", f"steps: {st['steps']} submitted and running after "
                f"{st['submit_to_all_running_s']} s; status meanwhile "
                f"{fmt(st['status_while_starting_ms'])}",
                f"  median supervisor after {st['idle_s']:g} s: Pss {m['Pss']} kB (anon "
                f"{m['Pss_Anon']}, file {m['Pss_File']}), USS {m['Uss']} kB, VmRSS "
                f"{m['VmRSS']} kB, {m['Threads']} threads, {m['fds']} fds; sum of Pss "
                f"{st['supervisors_pss_sum_mib']} MiB",
                f"  template {st['template']}, agent {st['agent']}"]
        out.append(f"  kernel memory (outside PSS) grew by, per step, in KiB: "
                   f"{st.get('kernel_per_step_kib')}")
        if st.get("ksm") is not None:
            out.append(f"  --ksm: ksmd counters at the weighing {st['ksm']}, ksmd CPU "
                       f"{st.get('ksmd_cpu_s')} s")
        for i, rd in enumerate(st.get("restarts", []), 1):
            out.append(f"  restart {i}: {rd}")
        out.append(f"  same supervisors after the restarts: "
                   f"{st.get('same_supervisors_after_restarts')}")
        sl = st.get("slurm")
        if sl:
            m = sl["slurmstepd_median"]
            out.append(f"  Slurm: {sl['steps']} steps running after {sl['all_running_s']} s; "
                       f"median slurmstepd after {sl['idle_s']:g} s: Pss {m['Pss']} kB (anon "
                       f"{m['Pss_Anon']}, file {m['Pss_File']}), VmRSS {m['VmRSS']} kB, "
                       f"{m['Threads']} threads, {m['fds']} fds; sum of Pss "
                       f"{sl['slurmstepd_pss_sum_mib']} MiB")
    mpi = r.get("mpi")
    if mpi:
        out += ["", "mpi (2 ranks):"]
        if "skipped" in mpi:
            out.append(f"  skipped: {mpi['skipped']}")
        else:
            out += [f"  {k:<11} {fmt(mpi[k])}" for k in ("tether", "mpiexec", "mpiexec_xml", "srun",
                                                  "python")
                    if k in mpi]
    if r.get("error"):
        out += ["", f"ERROR: {r['error']}"]
    out.append(f"\ncleanup: {r.get('cleanup', '?')}")
    return "\n".join(out)
