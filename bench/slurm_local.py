"""A throwaway single-node Slurm on this machine, for the benchmarks' side-by-side (issue 10).

    apt-get install -y slurm-wlm munge            # once (slurmctld, slurmd, slurm-client)
    eval "$(python3 bench/slurm_local.py start)"  # prints `export SLURM_CONF=...`
    .venv/bin/python bench/bench.py               # Slurm's side runs in the same loop
    python3 bench/slurm_local.py stop             # kills what start started, removes the dir

Everything lives in one ``mkdtemp(dir="/tmp", prefix="slurm")``: slurm.conf, the state save
location, slurmd's spool, logs and pid files, and (when no munged answers on its default socket)
a munged with a throwaway key. The node is this host (``slurmd -C``: its CPUs and memory),
reached on 127.0.0.1, on two ports the kernel had free. Tasks are tracked by
proctrack/linuxproc (no cgroups to leave behind), bound by task/affinity; ``MpiDefault=pmi2``.
Nothing outside the directory is written, so ``stop`` (or removing the directory after killing
the processes that hold files in it) undoes everything. Standard library only: it runs under
the system python3, no venv needed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

MARK = "slurm_local"  # a file only this script creates: `stop` removes no other directory


def free_ports(n: int) -> list[int]:
    """Ports nothing listens on now (the kernel's pick; a tiny race before slurm binds them)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def munge_answers(sock: str | None = None) -> bool:
    """Does a munged answer on ``sock`` (the default one if None)?"""
    argv = ["munge", "-n"] + (["-S", sock] if sock else [])
    try:
        cred = subprocess.run(argv, capture_output=True, timeout=10, check=True).stdout
        subprocess.run(["unmunge"] + (["-S", sock] if sock else []), input=cred,
                       capture_output=True, timeout=10, check=True)
        return True
    except (OSError, subprocess.SubprocessError):
        return False


def poll(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"slurm_local: timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


def node_line() -> str:
    """This host as slurmd sees it (CPUs, sockets, cores, RealMemory), reached on loopback."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("NodeName="))
    return f"{line} NodeAddr=127.0.0.1 State=UNKNOWN"


def write_conf(d: str, munge_sock: str | None, extra: list[str]) -> str:
    host = socket.gethostname().split(".")[0]
    ctld, slurmd = free_ports(2)
    conf = os.path.join(d, "slurm.conf")
    lines = [
        "ClusterName=local",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld}",
        f"SlurmdPort={slurmd}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        *([f"AuthInfo=socket={munge_sock}"] if munge_sock else []),
        f"StateSaveLocation={d}/state",
        f"SlurmdSpoolDir={d}/spool",
        f"SlurmctldPidFile={d}/slurmctld.pid",
        f"SlurmdPidFile={d}/slurmd.pid",
        f"SlurmctldLogFile={d}/slurmctld.log",
        f"SlurmdLogFile={d}/slurmd.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/affinity",
        "MpiDefault=pmi2",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "ReturnToService=2",
        "MailProg=/bin/true",
        "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        node_line(),
        # a PartitionName= line of --set replaces this one
        *([] if any(x.startswith("PartitionName=") for x in extra) else
          ["PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP"]),
        *extra,
    ]
    with open(conf, "w") as f:
        f.write("\n".join(lines) + "\n")
    return conf


def start_munged(d: str) -> str:
    """A munged of our own, throwaway key, socket in ``d``; returns the socket path."""
    key = os.path.join(d, "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    sock = os.path.join(d, "munge.sock")
    subprocess.run(["munged", "--force", f"--socket={sock}", f"--key-file={key}",
                    f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                    f"--seed-file={d}/munged.seed"], check=True)
    poll(lambda: munge_answers(sock), 20, "munged")
    return sock


def node_idle(env: dict[str, str]) -> bool:
    res = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env,
                         timeout=10)
    return res.returncode == 0 and res.stdout.strip() == "idle"


def start(extra: list[str]) -> int:
    for tool in ("slurmctld", "slurmd", "sinfo", "munge"):
        if not shutil.which(tool):
            raise SystemExit(f"slurm_local: no {tool}; apt-get install -y slurm-wlm munge")
    d = tempfile.mkdtemp(dir="/tmp", prefix="slurm")
    open(os.path.join(d, MARK), "w").close()
    for sub in ("state", "spool"):
        os.mkdir(os.path.join(d, sub))
    try:
        munge_sock = None if munge_answers() else start_munged(d)
        conf = write_conf(d, munge_sock, extra)
        env = {**os.environ, "SLURM_CONF": conf}
        # both daemonize and write their pid files; -c: no state to recover (a fresh dir)
        subprocess.run(["slurmctld", "-c", "-f", conf], check=True, env=env)
        subprocess.run(["slurmd", "-f", conf], check=True, env=env)
        poll(lambda: node_idle(env), 60, f"the node to be idle (logs in {d})")
    except BaseException:
        stop(d)
        raise
    print(f"export SLURM_CONF={conf}")
    return 0


def holders(d: str) -> list[int]:
    """Processes with their cwd or an open file in ``d``: the daemons (pid and log files),
    every slurmstepd (it writes slurmd's log) and whatever a step left running there."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            links = [os.readlink(f"/proc/{name}/cwd")]
            fds = f"/proc/{name}/fd"
            links += [os.readlink(os.path.join(fds, fd)) for fd in os.listdir(fds)]
        except OSError:
            continue
        if any(x == d or x.startswith(d + "/") for x in links):
            out.append(int(name))
    return out


def stop(d: str) -> None:
    if not os.path.exists(os.path.join(d, MARK)):
        raise SystemExit(f"slurm_local: {d} was not made by slurm_local; not touching it")
    conf = os.path.join(d, "slurm.conf")
    if os.path.exists(conf) and shutil.which("scancel"):
        # jobs first, so that slurmstepd ends its tasks (linuxproc: killing it would orphan them)
        env = {**os.environ, "SLURM_CONF": conf}
        try:
            subprocess.run(["scancel", "--full", "--user", str(os.getuid())],
                           capture_output=True, env=env, timeout=30)
        except subprocess.TimeoutExpired:  # no controller (a failed start): nothing to cancel
            pass

        def no_jobs() -> bool:  # none pending, running or completing (or no controller)
            try:
                res = subprocess.run(["squeue", "-h"], capture_output=True, env=env, timeout=10)
            except subprocess.TimeoutExpired:
                return True
            return res.returncode != 0 or not res.stdout.strip()
        try:
            poll(no_jobs, 30, "the jobs to end")
        except SystemExit as exc:
            print(exc, file=sys.stderr)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in holders(d):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        try:
            poll(lambda: not holders(d), 10, "slurm's processes to exit")
            break
        except SystemExit:
            continue
    shutil.rmtree(d)
    print(f"slurm_local: stopped, {d} removed", file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("start", help="start munged (if needed), slurmctld, slurmd; print the "
                        "export line")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra slurm.conf line (repeatable); a PartitionName= line "
                    "replaces the default partition")
    st = sub.add_parser("stop", help="kill what start started, remove its directory")
    st.add_argument("dir", nargs="?", help="the directory (default: $SLURM_CONF's)")
    ns = p.parse_args()
    if ns.cmd == "start":
        return start(ns.set)
    d = ns.dir or os.path.dirname(os.environ.get("SLURM_CONF", ""))
    if not d:
        raise SystemExit("slurm_local stop: give the directory or set SLURM_CONF")
    stop(os.path.abspath(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
