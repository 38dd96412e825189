"""The agent's side of the cluster database (I/O): join, heartbeat, claim, report, declare down.

Every function is one call of a function of ``shared/cluster_funcs.py``, one statement on the
agent's own autocommit connection, as the node's own role: the database knows which node calls
and lets it change only its own rows. The one lock another agent may hold for a while is the
claims' own (one plan at a time, shared/cluster_sched.py: a claim's length, bounded by
``lock_timeout``); claims and node reaping take rows ``FOR UPDATE SKIP LOCKED``; the rest lock
one row the caller owns. A node's clock never matters: heartbeat ages are measured with the
database server's ``clock_timestamp()``.

Why a result cannot be recorded twice or for the wrong attempt: ``tether_report`` locks the
job's row and writes the result only if the row still names this node, this attempt and an
active state, in the same transaction. Declaring a node down moves its jobs out of those
states in one transaction, so a late result from that node finds the job pending, elsewhere or
final, and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from tether.shared.cluster_db import Conn, NodeNotUp, call, translated
from tether.shared.cluster_sql import ACTIVE


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    host: str
    state_dir: str
    cpus: int
    gpus: int
    memory_mb: int
    version: str
    session: str
    #: a login node: serves its users' requests, owns no resources, claims nothing
    login: bool = False


def register(conn: Conn, info: NodeInfo) -> str:
    """Join (or rejoin) the cluster: ``new`` (never joined), ``down`` (declared down meanwhile)
    or ``up``. A node that was not up stays down until ``mark_up``, after the caller has
    reconciled."""
    return str(call(conn, "SELECT tether_register(%s, %s, %s, %s, %s, %s, %s, %s, %s)",
                     (info.name, info.host, info.state_dir, info.cpus, info.gpus,
                      info.memory_mb, info.version, info.session, info.login)))


def mark_up(conn: Conn, info: NodeInfo) -> None:
    call(conn, "SELECT tether_mark_up(%s)", (info.session,))


def heartbeat(conn: Conn, info: NodeInfo) -> str:
    """``up``, ``draining``, ``down`` (declared down meanwhile) or ``taken`` (another agent
    registered this name since)."""
    return str(call(conn, "SELECT tether_heartbeat(%s)", (info.session,)))


def reap(conn: Conn) -> list[dict[str, Any]]:
    """Declare down every node whose heartbeat is older than the cluster's timeout (the
    database decides, by its clock, and only for a caller that is up itself); its jobs are
    requeued, failed or cancelled. Returns what it did, per node."""
    done = call(conn, "SELECT tether_reap()")
    return list(done or [])


def my_jobs(conn: Conn, me: str) -> list[dict[str, Any]]:
    """The active jobs the database says this node runs."""
    rows = conn.execute(
        "SELECT id, attempt, state, local_job, cancel_requested FROM tether_jobs WHERE node = %s "
        "AND state = ANY(%s)", (me, list(ACTIVE))).fetchall()
    return rows


def claim(conn: Conn, info: NodeInfo, free: tuple[int, int, int]) -> list[dict[str, Any]] | None:
    """Plan the cluster's queue and claim what the plan starts here, within ``free``
    (shared/cluster_sched.py): their rows (with ``env`` and the new ``attempt``), or None when
    this node may not take work (not up: rejoin).

    The database commits the claims before the caller records them locally: a crash between
    the two leaves claims with no local job, which the next reconcile queues again."""
    try:
        rows = conn.execute("SELECT tether_claim(%s, %s, %s, %s) AS row",
                            (info.session, *free)).fetchall()
    except psycopg.errors.LockNotAvailable:
        # other nodes' plans held the claims' lock past lock_timeout: nothing claimed this
        # pass (the next heartbeat plans again); the pass, and its lease, go on
        return []
    except psycopg.Error as exc:
        err = translated(exc)
        if isinstance(err, NodeNotUp):
            return None
        raise err from None
    return [r["row"] for r in rows]


def set_running(conn: Conn, job: int, attempt: int, local_job: int,
                fields: dict[str, Any]) -> None:
    call(conn, "SELECT tether_set_running(%s, %s, %s, %s, %s, %s, %s, %s)",
         (job, attempt, local_job, fields["started_at"], Jsonb(fields["cpus"]),
          Jsonb(fields["gpus"]), Jsonb(fields["pids"]), fields["supervisor_pid"]))


def report(conn: Conn, job: int, attempt: int, result: dict[str, Any]) -> str | None:
    """Record a final result for (job, attempt); None if recorded, else why it was refused."""
    refused = call(conn, "SELECT tether_report(%s, %s, %s)", (job, attempt, Jsonb(result)))
    return None if refused is None else str(refused)


def requeue_unknown(conn: Conn, job: int, attempt: int, why: str) -> bool:
    """A claim this node holds in the database but never recorded locally: it never ran here,
    so it goes back to the queue (or ends cancelled if that was asked)."""
    return bool(call(conn, "SELECT tether_requeue_unknown(%s, %s, %s)", (job, attempt, why)))


def leave_if_idle(conn: Conn, info: NodeInfo) -> bool:
    """Set the node ``down`` unless the database says it still runs something."""
    return bool(call(conn, "SELECT tether_leave_if_idle(%s)", (info.session,)))
