"""What a step's ranks share and wait for: the write-once store (the KVS, node attributes,
published names), the barrier/fence sequence, finalize and abort, and the bookkeeping that turns
a collective or a held request that can never be answered into Broken.

Why a module of its own: the commands (pmi_commands.py) and the server's driving API (pmi.py's
``feed``, ``rank_exited``) both act on this state, and its rules are the subtle part of the
server: write-once keys, staged PMI-2 puts made visible by the fence that completes, a
collective that needs all ``size`` ranks whichever protocol each speaks, and the first failure
being the only one told (pmi.py's docstring, "Races and edges"). Each operation is a function
of the server (``srv``); its state stays in ``PmiState``'s attributes, which the handover
pickles (handover.FORMAT unchanged). pmi.py imports this module at its end, once those classes
exist.
"""

from __future__ import annotations

from typing import Any

from tether.supervisor.pmi_state import (
    ENTRY_OVERHEAD,
    Abort,
    Broken,
    Finalized,
    Output,
    PmiState,
    Send,
    _int,
    _Rank,
    _Refused,
    _StreamError,
)
from tether.supervisor.pmi_wire import preview

# ---- the store ----------------------------------------------------------------------------------


def store(
    srv: PmiState, table: dict[str, str], key: str, value: str, old: str | None, what: str
) -> None:
    """Insert once. PMI keys are write-once; an identical re-put is accepted as a retry."""
    if old is not None:
        if old != value:
            raise _Refused(f"{what} key {preview(key)} was already put with another value")
        return
    cost = len(key) + len(value) + ENTRY_OVERHEAD
    if srv._store_bytes + cost > srv.max_store_bytes:
        raise _Refused(f"{what} put refused: the step's PMI store is full (it may hold "
                       f"{_size(srv.max_store_bytes)}, each entry counted with "
                       f"{ENTRY_OVERHEAD} bytes of overhead; agent --pmi-store-mb)")
    srv._store_bytes += cost
    table[key] = value


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n & ((1 << 20) - 1) else f"{n} bytes"


def put_kvs(srv: PmiState, key: str, value: str, *, staged: bool) -> None:
    old = srv._kvs.get(key, srv._staged.get(key))
    store(srv, srv._staged if staged else srv._kvs, key, value, old, "KVS")


def publish(srv: PmiState, name: str, port: str) -> None:
    store(srv, srv._names, name, port, srv._names.get(name), "published name")


def unpublish(srv: PmiState, name: str) -> None:
    if srv._names.pop(name, None) is None:
        raise _Refused(f"service {preview(name)} is not published")


def lookup(srv: PmiState, name: str) -> str:
    port = srv._names.get(name)
    if port is None:
        raise _Refused(f"service {preview(name)} is not published")
    return port


# ---- collectives, finalize, abort ---------------------------------------------------------------


def enter_collective(srv: PmiState, st: _Rank, release: Send) -> list[Output]:
    if st.rank in srv._waiting:
        # The client blocks in this call, so a second entry means its stream is confused.
        raise _StreamError(f"entered barrier/fence #{srv._epoch + 1} twice")
    if st.finalized:
        raise _Refused("barrier/fence after finalize")
    if st.exited:  # late bytes from a dead rank: it cannot be released, so it is not in
        return check_stuck(srv, st.rank)
    srv._waiting[st.rank] = release
    if len(srv._waiting) < srv.size:
        return check_stuck(srv, st.rank)
    # Everyone is in: staged PMI-2 puts become visible, then everyone is released at once.
    srv._kvs.update(srv._staged)
    srv._staged.clear()
    srv._epoch += 1
    released = [srv._waiting[rank] for rank in sorted(srv._waiting)]
    srv._waiting.clear()
    return list(released)


def finalize(srv: PmiState, st: _Rank, reply: Send) -> list[Output]:
    if st.finalized:
        raise _Refused("PMI finalize was already done on this connection")
    st.finalized = True
    return [reply, Finalized(rank=st.rank), *check_stuck(srv, st.rank)]


def abort(srv: PmiState, st: _Rank, code_text: str | None, message: str) -> list[Output]:
    code = _int(code_text)
    code = 1 if code is None else code
    st.aborted = True
    if srv._failure is None:
        srv._failure = f"rank {st.rank} called PMI abort with exit code {code}: {message}"
    return [Abort(rank=st.rank, code=code, message=message)]


# ---- failure bookkeeping ------------------------------------------------------------------------


def check_stuck(srv: PmiState, culprit: int) -> list[Output]:
    """Broken if a waiting collective or a held nodeattr request can never be answered."""
    if srv._waiting:
        gone = [
            st.rank for st in srv._ranks if st.rank not in srv._waiting and not st.can_join
        ]
        if gone:
            rank = culprit if culprit in gone else gone[0]
            return broken(
                srv,
                rank,
                f"rank {rank} {_whereabouts(srv, rank)}, but ranks {rank_list(srv._waiting)} "
                f"wait in barrier/fence #{srv._epoch + 1}, which needs all {srv.size} ranks "
                "and so can never complete; ending the step",
            )
    if srv._node_waits:
        holders = {req.rank for reqs in srv._node_waits.values() for req in reqs}
        if not any(st.can_join and st.rank not in holders for st in srv._ranks):
            keys = ", ".join(sorted(srv._node_waits))
            return broken(
                srv,
                culprit,
                f"ranks {rank_list(holders)} wait for node attribute(s) {keys} that no remaining "
                f"rank can put (rank {culprit} {_whereabouts(srv, culprit)}); ending the step",
            )
    return []


def broken(srv: PmiState, rank: int, message: str) -> list[Output]:
    if srv._failure is not None:  # the step is already failing; its story is told
        return []
    srv._failure = message
    return [Broken(rank=rank, message=message)]


def _whereabouts(srv: PmiState, rank: int) -> str:
    st = srv._ranks[rank]
    if st.exited:
        ended = "exited with success" if st.exit_ok else "failed"
        return f"{ended}{'' if st.connected else ' without ever connecting to PMI'}"
    if st.finalized:
        return "has finalized PMI"
    if st.dead:
        return "broke its PMI stream"
    return "is still running"


def drop_node_waits(srv: PmiState, rank: int) -> None:
    for key in list(srv._node_waits):
        kept = [req for req in srv._node_waits[key] if req.rank != rank]
        if kept:
            srv._node_waits[key] = kept
        else:
            del srv._node_waits[key]


def rank_list(ranks: Any) -> str:
    return "[" + ", ".join(str(r) for r in sorted(ranks)) + "]"
