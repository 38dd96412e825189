"""The command line against a cluster: ``--cluster DSN`` (or ``TETHER_CLUSTER``) on any command.

With a DSN, submit/list/show/wait/cancel go to the cluster's PostgreSQL with today's flags and
outputs (the job object gains ``node``); ``inspect``/``attach``/``signal`` find the job's node and
talk to its supervisor there (on that machine); ``nodes``, ``drain``, ``resume`` and
``cluster init`` exist only here. Without one, every command behaves exactly as standalone.

psycopg is imported only when a DSN is given, so standalone commands start no slower.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tether.cli.errors import EXIT_ERROR, EXIT_TIMEOUT, EXIT_USAGE, CliError
from tether.cli.format import exit_status, print_job
from tether.shared.errors import NotFound, TetherError

if TYPE_CHECKING:
    from tether.shared.cluster_db import Conn
    from tether.shared.paths import Layout

#: Commands that exist only against a cluster.
CLUSTER_ONLY = ("nodes", "drain", "resume", "cluster")
#: Commands about this node's own agent and supervisors: the same with or without a cluster.
LOCAL_ONLY = ("status", "upgrade-supervisors")


def dsn_of(ns: argparse.Namespace) -> str | None:
    return getattr(ns, "cluster", None) or os.environ.get("TETHER_CLUSTER") or None


def agent_cluster(ns: argparse.Namespace) -> Any:
    """The agent's cluster settings, or None for a standalone agent."""
    dsn = dsn_of(ns)
    if dsn is None:
        if ns.heartbeat is not None:
            raise CliError("agent: --heartbeat needs --cluster DSN", EXIT_USAGE)
        return None
    from tether.agent.cluster import ClusterConfig

    return ClusterConfig(dsn=dsn, heartbeat=ns.heartbeat or 2.0)


def clustered(layout: Layout, ns: argparse.Namespace) -> int | None:
    """Run ``ns`` against the cluster, or None when it is a standalone command."""
    dsn = dsn_of(ns)
    if dsn is None:
        if ns.cmd in CLUSTER_ONLY and not names_job(ns):
            raise CliError(f"{ns.cmd}: needs a cluster (--cluster DSN or TETHER_CLUSTER)",
                           EXIT_USAGE)
        if getattr(ns, "no_requeue", False):
            raise CliError("submit: --no-requeue applies to cluster jobs (--cluster DSN)",
                           EXIT_USAGE)
        return None
    if ns.cmd in LOCAL_ONLY:
        return None
    if ns.cmd not in COMMANDS:  # a verb that only knows one node's agent (e.g. top)
        raise CliError(f"{ns.cmd}: not available for a cluster yet (without --cluster and "
                       "TETHER_CLUSTER it shows this node's agent)", EXIT_USAGE)
    for name in ("job", "jobs"):  # cluster jobs are plain ids: no arrays there yet
        refs = getattr(ns, name, None)
        if isinstance(refs, str | list):
            plain = [int(r) for r in ([refs] if isinstance(refs, str) else refs)
                     if isinstance(r, int) or "_" not in r]
            if len(plain) != (1 if isinstance(refs, str) else len(refs)):
                raise CliError(f"{ns.cmd}: cluster jobs have no array elements (ID_INDEX)",
                               EXIT_USAGE)
            setattr(ns, name, plain[0] if isinstance(refs, str) else plain)
    import psycopg

    from tether.shared import cluster_db

    try:
        if ns.cmd == "cluster":
            conn = cluster_db.connect(dsn, application="tether cluster init")
        else:
            conn = cluster_db.open_checked(dsn, application=f"tether {ns.cmd}")
    except cluster_db.ClusterError as exc:
        raise CliError(exc.message) from None
    try:
        return COMMANDS[ns.cmd](conn, dsn, ns)
    except psycopg.Error as exc:
        raise CliError(f"the cluster database failed: {cluster_db.one_line(exc)}") from None
    finally:
        conn.close()


# ---- commands -------------------------------------------------------------------------------


def cmd_init(conn: Conn, dsn: str, ns: argparse.Namespace) -> int:
    from tether.shared import cluster_db

    res = cluster_db.init(conn, ns.heartbeat_timeout)
    if ns.json:
        print(json.dumps(res))
    else:
        print(f"cluster schema version {res['schema_version']} ready (heartbeat timeout "
              f"{res['heartbeat_timeout']:g}s)")
    return 0


def _user(name: str | None) -> pwd.struct_passwd:
    if name is None:
        return pwd.getpwuid(os.getuid())
    if os.geteuid() != 0:
        raise CliError("submit: --user needs root")
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise CliError(f"submit: no user {name!r}") from None


#: what ``submit`` carries to the cluster; an option added to ``submit`` later is refused with
#: --cluster until the cluster carries it too (rather than silently dropped)
SUBMIT_KEYS = frozenset({"cluster", "cmd", "command", "cpus", "env", "error", "gpus", "json",
                         "memory_mb", "name", "no_requeue", "ntasks", "output", "pmi",
                         "state_dir", "user", "wait", "workdir"})


#: options whose name is not their destination's
OPTION_OF = {"time_limit": "--time"}


def cmd_submit(conn: Conn, dsn: str, ns: argparse.Namespace) -> int:
    from tether.agent.api import MAX_COMMAND_BYTES
    from tether.shared import cluster_db
    from tether.shared.timers import rfc3339_now

    unsupported = sorted(k for k, v in vars(ns).items() if k not in SUBMIT_KEYS and v)
    if unsupported:
        names = ", ".join(OPTION_OF.get(k, "--" + k.replace("_", "-")) for k in unsupported)
        raise CliError(f"submit: {names} not supported for cluster jobs yet", EXIT_USAGE)
    command = list(ns.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command or not command[0]:
        raise CliError("submit: missing the command to run (tether submit [OPTIONS] -- CMD)",
                       EXIT_USAGE)
    if sum(len(a.encode()) + 1 for a in command) > MAX_COMMAND_BYTES:
        raise CliError(f"submit: the command line is longer than {MAX_COMMAND_BYTES} bytes")
    workdir = os.path.abspath(ns.workdir or os.getcwd())
    if not os.path.isdir(workdir):
        raise CliError(f"submit: working directory {workdir} does not exist or is not a "
                       "directory")
    paths = {}
    for label in ("output", "error"):
        value = getattr(ns, label)
        if value:
            path = os.path.normpath(os.path.join(workdir, value))
            if not os.path.isdir(os.path.dirname(path)):
                raise CliError(f"submit: {label} file {path}: its directory does not exist")
            paths[label] = path
    user = _user(ns.user)
    env = dict(os.environ)  # like sbatch's default --export=ALL
    env.update(dict(ns.env))
    env = {k: v for k, v in env.items() if "\0" not in k + v}
    fields = {"name": (ns.name or os.path.basename(command[0]))[:256], "command": command,
              "cpus_per_task": ns.cpus, "ntasks": ns.ntasks, "gpus_req": ns.gpus,
              "memory_mb": ns.memory_mb, "workdir": workdir, "env": env,
              "submitted_at": rfc3339_now(), "pmi": ns.pmi, "username": user.pw_name,
              "uid": user.pw_uid, "gid": user.pw_gid, "requeue": not ns.no_requeue}
    try:
        job = cluster_db.submit(conn, fields, paths.get("output"), paths.get("error"))
    except TetherError as exc:
        raise CliError(exc.message) from None
    if ns.json and not ns.wait:
        print(json.dumps(job))
    else:
        print(job["id"], flush=True)
    if ns.wait:
        return wait_for(conn, dsn, job["id"], None, as_json=ns.json)
    return 0


def all_jobs(conn: Conn) -> list[dict[str, Any]]:
    from tether.shared import cluster_db

    jobs: list[dict[str, Any]] = []
    while True:
        page = cluster_db.list_jobs(conn, jobs[-1]["id"] if jobs else 0)
        if not page:
            return jobs
        jobs.extend(page)


def cmd_list(conn: Conn, dsn: str, ns: argparse.Namespace) -> int:
    from tether.cli.jobfilter import select
    from tether.cli.table import CLUSTER_FORMAT, parse_format, render

    cols = parse_format(ns.format or CLUSTER_FORMAT)
    jobs = select(all_jobs(conn), ns)
    if ns.json:
        print(json.dumps(jobs))
        return 0
    for line in render(jobs, cols, header=not ns.no_header):
        print(line)
    return 0


def _job(conn: Conn, job: int) -> dict[str, Any]:
    from tether.shared import cluster_db

    try:
        return cluster_db.get_job(conn, job)
    except NotFound as exc:
        raise CliError(exc.message) from None


def cmd_show(conn: Conn, dsn: str, ns: argparse.Namespace) -> int:
    job = _job(conn, ns.job)
    if ns.json:
        print(json.dumps(job))
    else:
        print_job(job)
        print(f"{'node':<15}{job['node'] or ''}")
    return 0


def cmd_wait(conn: Conn, dsn: str, ns: argparse.Namespace) -> int:
    _job(conn, ns.job)  # an unknown job is an error, not a wait
    return wait_for(conn, dsn, ns.job, ns.timeout)


def wait_for(conn: Conn, dsn: str, job: int, timeout: float | None,
             as_json: bool = False) -> int:
    """Until the job is final: LISTEN for its changes, re-read it after each (and every few
    seconds); a database that goes away is waited for, like a restarting agent."""
    import psycopg

    from tether.shared import cluster_db
    from tether.shared.cluster_sql import CHANNEL_JOB, FINAL

    deadline = None if timeout is None else time.monotonic() + timeout
    live: Conn | None = conn
    warned = False
    while True:
        left = 5.0 if deadline is None else deadline - time.monotonic()
        if left <= 0:
            print(f"tether: job {job} did not end within {timeout:g}s", file=sys.stderr)
            return EXIT_TIMEOUT
        try:
            if live is None:
                live = cluster_db.open_checked(dsn, application="tether wait")
            cluster_db.listen(live, CHANNEL_JOB)
            row = cluster_db.get_job(live, job)
            if row["state"] in FINAL:
                if as_json:
                    print(json.dumps(row))
                return exit_status(row)
            for n in live.notifies(timeout=min(left, 5.0)):
                if n.payload == str(job):
                    break
        except (cluster_db.ClusterUnreachable, psycopg.OperationalError) as exc:
            if not warned:
                print(f"tether: {exc}; still waiting", file=sys.stderr)
                warned = True
            if live is not None and live is not conn:
                live.close()
            live = None
            time.sleep(min(0.5, max(0.0, left)))


def cmd_cancel(conn: Conn, dsn: str, ns: argparse.Namespace) -> int:
    """As standalone ``cancel``: named jobs, filters, or both."""
    from tether.cli.jobfilter import ALIASES, select
    from tether.shared import cluster_db
    from tether.shared.errors import StateError

    filtered = ns.state is not None or ns.user is not None or ns.name is not None
    if not ns.jobs and not filtered:
        raise CliError("cancel: name the jobs: JOB... or --state, --user, --name", EXIT_USAGE)
    targets: list[int] = list(dict.fromkeys(ns.jobs))
    if filtered:
        if ns.state is None:  # by default only what can still be cancelled
            ns.state = frozenset(ALIASES["active"])
        chosen = [j["id"] for j in select(all_jobs(conn), ns)]
        targets = [i for i in targets if i in set(chosen)] if targets else chosen
    failed = 0
    for job in targets:
        try:
            cluster_db.cancel(conn, job)
        except TetherError as exc:
            if filtered and not ns.jobs and isinstance(exc, StateError):
                continue
            print(f"tether: {exc.message}", file=sys.stderr)
            failed += 1
    return EXIT_ERROR if failed else 0


def cmd_nodes(conn: Conn, dsn: str, ns: argparse.Namespace) -> int:
    from tether.shared import cluster_db

    nodes = cluster_db.list_nodes(conn)
    if ns.json:
        print(json.dumps(nodes))
        return 0
    print(f"{'NAME':<14}{'STATE':<10}{'CPUS':>9}{'GPUS':>7}{'MEMORY_MB':>17}{'JOBS':>6}  "
          f"{'HEARTBEAT':<26}VERSION")
    for n in nodes:
        cpus, gpus, mem = (f"{n[k]['allocated']}/{n[k]['total']}"
                           for k in ("cpus", "gpus", "memory_mb"))
        print(f"{n['name']:<14}{n['state']:<10}{cpus:>9}{gpus:>7}{mem:>17}{n['running']:>6}  "
              f"{n['heartbeat']:<26}{n['version']}")
    return 0


def cmd_drain(conn: Conn, dsn: str, ns: argparse.Namespace) -> int:
    from tether.shared import cluster_db

    try:
        cluster_db.set_drain(conn, ns.node, ns.cmd == "drain")
    except NotFound as exc:
        raise CliError(exc.message) from None
    return 0


def names_job(ns: argparse.Namespace) -> bool:
    """``resume`` takes a job (digits, or ``ARRAY_INDEX``) or a node (anything else): node
    names of that form cannot be resumed by name (docs/cli.md)."""
    from tether.cli.cmd_suspend import names_job as is_job

    return ns.cmd == "resume" and is_job(str(ns.node))


def cmd_resume(conn: Conn, dsn: str, ns: argparse.Namespace) -> int:
    if not names_job(ns):
        return cmd_drain(conn, dsn, ns)
    if not str(ns.node).isdigit():
        raise CliError(f"resume: {ns.node}: with --cluster, name the element by its own job id")
    ns.job = int(ns.node)
    return cmd_on_node(conn, dsn, ns)


def cmd_on_node(conn: Conn, dsn: str, ns: argparse.Namespace) -> int:
    """inspect, attach, signal: on the machine of the job's node, through its supervisor."""
    from tether.cli import main
    from tether.shared import cluster_db
    from tether.shared.paths import Layout

    try:
        at = cluster_db.where(conn, ns.job)
    except NotFound as exc:
        raise CliError(exc.message) from None
    if at["node"] is None or at["local_job"] is None:
        raise CliError(f"job {ns.job} is {at['state']}: it runs on no node")
    if at["host"] != socket.gethostname():
        raise CliError(f"job {ns.job} runs on node {at['node']} (host {at['host']}): run "
                            f"`tether {ns.cmd}` there")
    local = argparse.Namespace(**vars(ns))
    local.job = at["local_job"]
    handler: Callable[[Layout, argparse.Namespace], int] = main.load(main.VERBS[ns.cmd])
    return handler(Layout(at["state_dir"]), local)


COMMANDS: dict[str, Callable[[Conn, str, argparse.Namespace], int]] = {
    "cluster": cmd_init, "submit": cmd_submit, "list": cmd_list, "show": cmd_show,
    "wait": cmd_wait, "cancel": cmd_cancel, "nodes": cmd_nodes, "drain": cmd_drain,
    "resume": cmd_resume, "suspend": cmd_on_node, "inspect": cmd_on_node,
    "attach": cmd_on_node, "signal": cmd_on_node,
}
