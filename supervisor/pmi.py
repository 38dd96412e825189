"""A PMI server for one step, a pure state machine: bytes in, outputs out; no sockets, os, clocks.

Theory of operation. The supervisor is the real parent of a step's ranks and the only process
that can serve their PMI: MPICH's client never reconnects, so the server must live as long as
the ranks do (docs/pmi.md). The I/O layer owns one socketpair per rank (PMI_FD) and the reaper.
It drives this module with two calls and acts on what they return, in order:

    feed(rank, data)          bytes read from that rank's PMI fd, split anywhere
    rank_exited(rank, ok)     the reaper saw that rank's process end

    Send(rank, data)          write these bytes to that rank's fd
    Finalized(rank)           the rank said PMI finalize (already answered)
    Abort(rank, code, msg)    the rank asked for the job to die; it waits for that, reply-less
    ProtocolError(rank, msg)  the rank's byte stream is garbage; fail the step
    Broken(rank, msg)         a barrier/fence or a held request can never be answered now;
                              fail the step instead of leaving ranks asleep in read() forever

Framing. Every rank starts in PMI-1 line framing (``cmd=name k=v k=v\\n``, values without
spaces, at most 1024 bytes a line). ``cmd=init pmi_version=1`` keeps it there. A PMI-2 client
also opens with that line but says ``pmi_version=2``; the reply is still a line, and from the
next byte on its stream is PMI-2 frames: a 6-character decimal length (left- or right-justified,
both clients and Hydra parse it with atoi) and then that many bytes of ``cmd=name;k=v;k=v;``
with ``;`` inside a value doubled. A rank whose very first byte is a digit or a space skipped
the handshake and is read as PMI-2 from the start. Bytes are decoded as latin-1, so any byte
round-trips and nothing raises on odd input.

State. One KVS per step, shared by both protocols, seeded with ``PMI_process_mapping`` and
``universeSize``. A PMI-1 put is visible at once: MPICH's PMI_KVS_Commit is a no-op and its
barrier is the fence. A PMI-2 kvs-put is staged and becomes visible when the next fence
completes, as the PMI-2 spec says. barrier_in and kvs-fence are one collective: it completes
when all ``size`` ranks are in it, whichever protocol each speaks. Node attributes (PMI-2) are
visible at once and release any ``info-getnodeattr wait=TRUE`` held for that key. Names
(publish/lookup) live in the step; there is no cross-job name service.

Failures. feed() and rank_exited() never raise on anything a rank sends; they raise ValueError only
for a rank index outside 0..size-1, which is the caller's bug. A peer's mistake in one command
(unknown command, oversized key or value, a missing key, a second init) gets an error reply and the
rank carries on; the client then fails in its own code with a message. A stream that cannot be
parsed any more (bad framing, a line or frame past any sane size) yields ProtocolError and the rest
of that rank's input is ignored. The first failure is recorded (snapshot()["failure"]) and later
Broken events are suppressed: the step is already ending, and its story is the first failure.

Races and edges, and what this module does about them:
 1. EOF means nothing: a rank's children inherit PMI_FD, so the I/O layer must report deaths
    from the reaper (rank_exited), never from EOF.
 2. A rank may exit before the I/O layer has fed its last bytes (e.g. a client that writes
    ``abort`` and exits). Input fed after rank_exited is still processed, so the Abort and its
    exit code still come out; replies to a dead rank are harmless to write.
 3. A rank that dies, or exits 0 without finalize, after connecting: every later collective
    needs it, so Broken at once unless every other rank has already finalized or exited.
 4. A rank that never connected (``true`` in a non-MPI step) breaks nothing by itself: only a
    collective that then waits for it (now or later) is Broken.
 5. A finalized rank cannot join a collective either: a barrier it did not enter is Broken.
 6. ``info-getnodeattr wait=TRUE`` is Broken when every rank that could still put is gone.
 7. Threaded PMI-2 clients may have several requests in flight; ``thrid`` is echoed in every
    reply, including held ones, and input keeps being served while a rank waits in a fence.
 8. Not detected here: deadlocks among live ranks (e.g. one rank waits for a node attribute
    that another would put only after a fence). PMI has no timeouts; the supervisor's own
    deadlines cover that.

Parts. This module holds the driving API (``PmiServer``); pmi_state.py its data;
pmi_framing.py takes requests off a rank's stream, pmi_commands.py answers them, pmi_kvs.py holds
what the ranks share (the store, barrier/fence, failure bookkeeping), pmi_wire.py is the codec.
"""

from __future__ import annotations

from typing import Any

from tether.supervisor import pmi_commands, pmi_framing, pmi_kvs
from tether.supervisor.pmi_state import (
    DEFAULT_MAX_STORE_BYTES,
    ENTRY_OVERHEAD,
    MAX_KVSNAME,
    Abort,
    Broken,
    Finalized,
    Output,
    PmiState,
    Protocol,
    ProtocolError,
    Send,
    _int,
    _Rank,
    _Refused,
    _Request,
    _StreamError,
    _Wire,
)
from tether.supervisor.pmi_wire import PmiSyntaxError

#: pmi.py is the API: the data's names are had from here (and a handover image of 0.6.0, which
#: pickled these classes under this module's name, still finds them here)
__all__ = [
    "DEFAULT_MAX_STORE_BYTES", "ENTRY_OVERHEAD", "MAX_KVSNAME", "Abort", "Broken", "Finalized",
    "Output", "PmiServer", "PmiState", "Protocol", "ProtocolError", "Send", "_Rank", "_Refused",
    "_Request", "_StreamError", "_Wire", "_int",
]

# ---- the server ---------------------------------------------------------------------------------


class PmiServer(PmiState):
    """The PMI server of one step: its state (pmi_state.py) and the API that drives it."""

    def __repr__(self) -> str:
        return (
            f"<PmiServer job={self.jobid} size={self.size} epoch={self._epoch} "
            f"waiting={sorted(self._waiting)} kvs={len(self._kvs)} failure={self._failure!r}>"
        )

    # ---- public driving API ---------------------------------------------------------------------

    def feed(self, rank: int, data: bytes) -> list[Output]:
        """Take bytes read from ``rank``'s PMI fd; return what to send and what happened."""
        st = self._rank(rank)
        if st.dead or not data:
            return []
        if st.received == 0 and data[0] in b"0123456789 ":
            # A length prefix as the very first byte: PMI-2 without the version handshake.
            st.wire, st.protocol = _Wire.FRAMES, Protocol.PMI2
        st.received += len(data)
        st.buffer += data
        out: list[Output] = []
        while not st.dead:
            try:
                item = pmi_framing.next_item(st)
                if item is None:
                    break
                out.extend(pmi_commands.handle(self, st, item))
            except (_StreamError, PmiSyntaxError) as exc:
                out.extend(self._stream_failed(st, str(exc)))
            except Exception as exc:  # a bug here must fail this step, not kill the supervisor
                out.extend(self._stream_failed(st, f"internal error in the PMI server: {exc!r}"))
        return out

    def rank_exited(self, rank: int, status_ok: bool) -> list[Output]:
        """The rank's process ended. Returns Broken if PMI can no longer make progress."""
        st = self._rank(rank)
        if st.exited:
            return []
        st.exited, st.exit_ok = True, status_ok
        # Nothing it asked for can be delivered now, and it is no longer in any collective:
        # left in, a collective could "complete" without it while the others then hang on it.
        self._waiting.pop(rank, None)
        pmi_kvs.drop_node_waits(self, rank)
        how = "exited with success" if status_ok else "failed"
        if st.connected and not st.finalized and not st.dead:
            still_need = [r.rank for r in self._ranks if r is not st and r.can_join]
            if still_need:
                return pmi_kvs.broken(
                    self,
                    rank,
                    f"rank {rank} {how} after connecting to PMI but without PMI finalize, while "
                    f"ranks {pmi_kvs.rank_list(still_need)} still need it for every later "
                    "barrier/fence; ending the step now instead of letting them hang",
                )
        return pmi_kvs.check_stuck(self, rank)

    def step_failing(self, reason: str) -> None:
        """The supervisor is ending the step for ``reason`` (a rank failed outside PMI) and is
        about to kill the other ranks: their deaths are its doing, not PMI failures, so nothing
        they cause is reported as the step's cause (the first failure's story is told)."""
        if self._failure is None:
            self._failure = reason

    def spoken(self) -> bool:
        """Has any rank sent its PMI fd a byte? (An MPI without a PMI-1/PMI-2 client never
        does: each of its ranks runs alone.)"""
        return any(st.connected for st in self._ranks)

    def snapshot(self) -> dict[str, Any]:
        """Plain data for introspection (JSON/msgpack-friendly)."""
        return {
            "jobid": self.jobid,
            "kvsname": self.kvsname,
            "size": self.size,
            "kvs_keys": len(self._kvs),
            "staged_puts": len(self._staged),
            "node_attrs": len(self._node_attrs),
            "names": len(self._names),
            "store_bytes": self._store_bytes,
            "epoch": self._epoch,
            "waiting": sorted(self._waiting),
            "node_waits": {k: sorted(req.rank for req in v) for k, v in self._node_waits.items()},
            "failure": self._failure,
            "ranks": [
                {
                    "rank": st.rank,
                    "protocol": st.protocol.value if st.protocol else None,
                    "connected": st.connected,
                    "initialized": st.initialized or st.fullinit,
                    "finalized": st.finalized,
                    "aborted": st.aborted,
                    "exited": st.exited,
                    "exit_ok": st.exit_ok,
                    "stream_failed": st.dead,
                    "buffered": len(st.buffer),
                }
                for st in self._ranks
            ],
        }

    # ---- a rank and its stream ------------------------------------------------------------------

    def _rank(self, rank: int) -> _Rank:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside this step's 0..{self.size - 1}")
        return self._ranks[rank]

    def _stream_failed(self, st: _Rank, message: str) -> list[Output]:
        st.dead = True
        st.buffer.clear()
        st.block = None
        pmi_kvs.drop_node_waits(self, st.rank)
        text = f"rank {st.rank} sent bytes that are not PMI ({message}); its stream is abandoned"
        if self._failure is None:
            self._failure = text
        return [ProtocolError(rank=st.rank, message=text)]

