"""A cluster node's lease: how the step supervisors of a cluster job know their node is still
in the cluster, and stop their tasks themselves when it may not be (pure but for two file
helpers).

Why. A node that stops answering (its agent killed or stopped, its network cut) cannot be told
from outside from one that still runs its jobs. The cluster requeues a lost node's jobs only
after the heartbeat timeout plus a margin (``fence_margin``); by then the node's own supervisors
must have killed their tasks, or the job would run twice. A stopped or dead agent cannot do
that, so the supervisors do (Nomad's ``stop_on_client_after``, a lease holder that stops acting
before its lease ends).

How. After each heartbeat the database accepted, the agent writes the lease file in its state
directory: the CLOCK_BOOTTIME at which it *sent* that heartbeat (never later than the moment the
database stamped it). A supervisor of a cluster job reads it every second; once it is older
than the heartbeat timeout by this machine's own clock, the supervisor kills its tasks and ends
the step with a reason that starts with ``FENCED``. The database declares the node down only
when its heartbeat is older than the timeout plus the margin, by the database's clock, and only
then runs the job elsewhere: the margin covers a second's check, the kill and clock rates.

A database that refuses connections (stopped, restarting: ``connection refused``, no socket,
"the database system is starting up") is an outage, not this node's loss: nobody can requeue
anything meanwhile, so the agent goes on renewing the lease while every attempt is refused
(``cluster.py``). A database that cannot be reached at all (no answer) looks exactly like this
node being cut off, and is taken as such.
"""

from __future__ import annotations

import time
from typing import Any

from tether.shared import records

#: how libpq and the server say the database is not serving (as opposed to not answering)
REFUSALS = ("Connection refused", "No such file or directory", "database system is starting up",
            "database system is shutting down", "database system is in recovery mode",
            "terminating connection due to administrator command")
#: the same as SQLSTATEs: admin_shutdown, crash_shutdown, cannot_connect_now
REFUSAL_STATES = ("57P01", "57P02", "57P03")

#: what a fenced step's reason begins with (the agent reports it as the node's loss, not as
#: the job's own failure: the cluster requeues it, or ends it node_fail)
FENCED = "fenced"


def refused(exc: BaseException) -> bool:
    """Did the database refuse to serve (an outage everyone sees), rather than not answer?"""
    if getattr(exc, "sqlstate", None) in REFUSAL_STATES:
        return True
    text = str(exc)
    return any(words in text for words in REFUSALS)


def now() -> float:
    """This machine's clock for leases: CLOCK_BOOTTIME (system-wide, goes on while suspended,
    never set back)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def write(path: str, sent: float, timeout: float, node: str) -> None:
    """Renew the lease: the heartbeat sent at ``sent`` (``now()``) was accepted."""
    records.atomic_write_json(path, {"schema": records.SCHEMA, "node": node, "since": sent,
                                     "timeout": timeout}, durable=False)


def read(path: str) -> float | None:
    """When the lease was last renewed (``now()``'s clock), or None if it cannot be read."""
    try:
        rec: Any = records.read_json(path, max_bytes=4096)
        return float(rec["since"])
    except (OSError, ValueError, TypeError, KeyError, records.RecordError):
        return None


def expired(since: float | None, started: float, after: float, at: float) -> bool:
    """Has the lease run out at ``at``? ``since``: its last renewal seen (None: never read, then
    the step's own start counts); ``after``: the heartbeat timeout."""
    return at - (since if since is not None else started) > after
