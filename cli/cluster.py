"""The command line and a cluster: where the connection string comes from, and the commands that
exist only there.

People never talk to the database. On a node whose agent is a cluster's member every command
goes to that agent, as on a lone node; the agent authenticated them (the kernel's credentials)
and answers from the cluster (``agent/cluster_api.py``). So this module has only:

- the agent's connection string: from ``--cluster-file`` (a file readable by the agent's user
  alone, as ssh wants a key) or ``TETHER_CLUSTER`` in its environment; never from its command
  line, which ``ps`` shows to everyone;
- the administrator's commands (``cluster init``, ``cluster add-node``), which connect as the
  tables' owner;
- ``nodes``, ``drain`` and ``resume NODE``, and the way ``inspect``, ``attach`` and ``signal``
  find a cluster job's supervisor (``locate``), all through the agent.

psycopg is imported only by the administrator's commands and the agent.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tether.cli.connect import agent_call
from tether.cli.errors import EXIT_USAGE, CliError
from tether.shared.errors import TetherError

if TYPE_CHECKING:
    from tether.shared.paths import Layout

#: the largest connection-string file read
MAX_SECRET = 64 * 1024


def read_secret(path: str, who: str) -> str:
    """The connection string in ``path``, a regular file of this user's that nobody else may
    read or write (refused otherwise, naming the file and what to do)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise CliError(f"{who}: cannot read cluster file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CliError(f"{who}: cluster file {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise CliError(f"{who}: cluster file {path} belongs to uid {st.st_uid}, not to this "
                           f"process's user (uid {os.geteuid()})")
        if st.st_mode & 0o077:
            raise CliError(f"{who}: cluster file {path} may be read or written by others (mode "
                           f"{stat.S_IMODE(st.st_mode):04o}): it holds a password; chmod 600 it")
        data = f.read(MAX_SECRET + 1)
    if len(data) > MAX_SECRET:
        raise CliError(f"{who}: cluster file {path} is larger than {MAX_SECRET} bytes")
    try:
        text = data.decode().strip()
    except UnicodeDecodeError:
        raise CliError(f"{who}: cluster file {path} is not UTF-8") from None
    if not text or "\n" in text or "\0" in text:
        raise CliError(f"{who}: cluster file {path} must hold one connection string on one line")
    return text


def agent_cluster(ns: argparse.Namespace) -> Any:
    """The agent's cluster settings, or None for a standalone agent. The connection string
    leaves the environment once read: nothing the agent starts inherits it."""
    if getattr(ns, "cluster", None):
        raise CliError("agent: --cluster DSN would show the database password to every user "
                       "(ps): put the connection string in a file only root can read and give "
                       "--cluster-file FILE (or TETHER_CLUSTER in the agent's environment)",
                       EXIT_USAGE)
    if ns.cluster_file:
        dsn: str | None = read_secret(ns.cluster_file, "agent")
        os.environ.pop("TETHER_CLUSTER", None)
    else:
        dsn = os.environ.pop("TETHER_CLUSTER", None) or None
    if dsn is None:
        for given, flag in ((ns.heartbeat, "--heartbeat"), (ns.login, "--login")):
            if given:
                raise CliError(f"agent: {flag} needs a cluster (--cluster-file FILE)",
                               EXIT_USAGE)
        return None
    from tether.agent.config import ClusterConfig

    return ClusterConfig(dsn=dsn, heartbeat=ns.heartbeat or 2.0, login=bool(ns.login))


# ---- the administrator's commands -----------------------------------------------------------


def admin(ns: argparse.Namespace) -> int:
    """``cluster init`` and ``cluster add-node``: straight to the database, as its owner."""
    import psycopg

    from tether.shared import cluster_db

    if ns.cluster_cmd == "node-down" and not ns.confirm_dead:  # bad usage: no database needed
        raise CliError(f"cluster node-down: its jobs would run elsewhere at once, twice if node "
                       f"{ns.name} still runs them: say --confirm-dead once it is known to be "
                       "off", EXIT_USAGE)
    if ns.cluster_file:
        dsn = read_secret(ns.cluster_file, f"cluster {ns.cluster_cmd}")
    else:
        dsn = os.environ.get("TETHER_CLUSTER", "")
    try:
        conn = cluster_db.connect(dsn, application=f"tether cluster {ns.cluster_cmd}")
    except cluster_db.ClusterError as exc:
        raise CliError(exc.message) from None
    try:
        return ADMIN[ns.cluster_cmd](conn, ns)
    except TetherError as exc:
        raise CliError(exc.message) from None
    except psycopg.Error as exc:
        raise CliError(f"the cluster database failed: {cluster_db.one_line(exc)}") from None
    finally:
        conn.close()


def cmd_init(conn: Any, ns: argparse.Namespace) -> int:
    from tether.shared import cluster_db

    root = None if ns.root_jobs is None else ns.root_jobs == "allow"
    requeue = None if ns.requeue is None else ns.requeue == "yes"
    res = cluster_db.init(conn, ns.heartbeat_timeout, root, ns.fence_margin, requeue,
                          ns.fairshare_half_life)
    if ns.json:
        print(json.dumps(res))
    else:
        print(f"cluster schema version {res['schema_version']} ready (heartbeat timeout "
              f"{res['heartbeat_timeout']:g}s, fence margin {res['fence_margin']:g}s, root jobs "
              f"{'allowed' if res['allow_root_jobs'] else 'denied'}, jobs of a lost node "
              f"{'requeued' if res['requeue'] else 'ended node_fail'} unless they say, "
              f"fair-share half-life {res['fairshare_half_life']:g}s, node group "
              f"{res['node_group']})")
    return 0


def cmd_add_node(conn: Any, ns: argparse.Namespace) -> int:
    from tether.shared import cluster_db

    res = cluster_db.add_node(conn, ns.name, ns.role, ns.host)
    if ns.write:
        write_secret(ns.write, res["dsn"])
        res = dict(res, dsn=None, written=os.path.abspath(ns.write))
    if ns.json:
        print(json.dumps(res))
    elif ns.write:
        print(f"node {res['node']}: role {res['role']}; its connection string is in "
              f"{res['written']} (mode 0600): give it to that node's agent as --cluster-file")
    else:
        print(f"# node {res['node']}, role {res['role']}: put the next line in a file only "
              "root can read on that node (mode 0600) and start its agent with "
              f"--cluster-file FILE --node {res['node']}", file=sys.stderr)
        print(res["dsn"])
    return 0


def write_secret(path: str, text: str) -> None:
    """``text`` into ``path``, created 0600 beside it and renamed over it (never a moment
    readable by others, never half written)."""
    path = os.path.abspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise CliError(f"cluster add-node: cannot write {path}: {exc.strerror}") from None


def cmd_node_down(conn: Any, ns: argparse.Namespace) -> int:
    from tether.shared import cluster_db

    assert ns.confirm_dead  # admin refused it without, before connecting
    res = cluster_db.confirm_dead(conn, ns.name)
    if ns.json:
        print(json.dumps(res))
    else:
        print(f"node {res['node']} is down; requeued jobs {res['requeued']}, ended jobs "
              f"{res['ended']}")
    return 0


ADMIN: dict[str, Callable[[Any, argparse.Namespace], int]] = {
    "init": cmd_init, "add-node": cmd_add_node, "node-down": cmd_node_down,
}


# ---- through the agent ----------------------------------------------------------------------


def cmd_nodes(layout: Layout, ns: argparse.Namespace) -> int:
    nodes = agent_call(layout, "nodes")
    if ns.json:
        print(json.dumps(nodes))
        return 0
    print(f"{'NAME':<14}{'STATE':<10}{'CPUS':>9}{'GPUS':>7}{'MEMORY_MB':>17}{'JOBS':>6}  "
          f"{'HEARTBEAT':<26}VERSION")
    for n in nodes:
        cpus, gpus, mem = (f"{n[k]['allocated']}/{n[k]['total']}"
                           for k in ("cpus", "gpus", "memory_mb"))
        state = n["state"] + ("*" if n.get("login") else "")
        print(f"{n['name']:<14}{state:<10}{cpus:>9}{gpus:>7}{mem:>17}{n['running']:>6}  "
              f"{n['heartbeat']:<26}{n['version']}")
    return 0


def cmd_drain(layout: Layout, ns: argparse.Namespace) -> int:
    agent_call(layout, "drain", {"node": ns.node, "drain": ns.cmd == "drain"})
    return 0


def is_member(layout: Layout) -> bool:
    """Is this state directory's agent a cluster's member (its job ids the cluster's)?"""
    return os.path.exists(layout.cluster_marker)


def located(layout: Layout, ns: argparse.Namespace) -> tuple[Layout, argparse.Namespace]:
    """``inspect``, ``attach``, ``signal`` of a cluster job: on this node, the node's own job
    id; on another, the same, reached through this node's agent (``connect.relay_to``)."""
    from tether.cli.connect import relay_to

    ref = str(ns.job)
    if not ref.isdigit():
        raise CliError(f"{ns.cmd}: cluster jobs are named by their own ids", EXIT_USAGE)
    at = agent_call(layout, "locate", {"job": int(ref), "verb": ns.cmd})
    if at["node"] is None or at["local_job"] is None:
        raise CliError(f"job {ref} is {at['state']}: it runs on no node yet")
    local = argparse.Namespace(**vars(ns))
    with open(layout.cluster_marker, "rb") as f:
        here = json.loads(f.read()).get("node")
    if at["node"] == here:
        local.job = int(at["local_job"])
    else:
        local.job = int(ref)
        relay_to(layout, int(ref), str(at["node"]))
    return layout, local
