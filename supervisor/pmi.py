"""A PMI server for one step, as a pure state machine: bytes in, outputs out. No sockets, no os,
no clocks.

Theory of operation
-------------------
The supervisor is the real parent of a step's ranks and the only process that can serve their
PMI: MPICH's client never reconnects, so the server must live as long as the ranks do
(docs/pmi.md). The I/O layer owns one socketpair per rank (PMI_FD) and the reaper. It
drives this module with two calls and acts on what they return, in order:

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

Failures. A peer's mistake in one command (unknown command, oversized key or value, a missing
key, a second init) gets an error reply and the rank carries on; the client then fails in its
own code with a message. A stream that cannot be parsed any more (bad framing, a line or frame
past any sane size) yields ProtocolError and the rest of that rank's input is ignored. The
first failure is recorded (snapshot()["failure"]) and later Broken events are suppressed: the
step is already ending, and its story is the first failure.

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

feed() and rank_exited() never raise on anything a rank sends. They raise ValueError only for
a rank index outside 0..size-1, which is the caller's bug.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from tether.supervisor.pmi_wire import (
    ABSURD_LINE_V1,
    MAX_COMMAND_V2,
    MAX_LINE_V1,
    V2_HEADER,
    V2_HEADER_LEN,
    PmiSyntaxError,
    Unencodable,
    encode_frame,
    encode_line,
    parse_frame,
    parse_line,
    preview,
)

# ---- limits -------------------------------------------------------------------------------------

#: kvsname_max advertised by get_maxes (Hydra's value); jobid and kvsname must fit in it.
MAX_KVSNAME = 256
#: Cap on bytes held in the KVS, node attributes and names together: a guard against a runaway
#: rank, not an accounting (nothing is refunded).
DEFAULT_MAX_STORE_BYTES = 64 * 1024 * 1024
#: How much of a dropped over-long line is kept, to name its command in the error reply.
_HEAD_LEN = 64

_SAFE_NAME = re.compile(r"[A-Za-z0-9_.:+-]+")


# ---- outputs ------------------------------------------------------------------------------------


def _check_rank(rank: int) -> None:
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Send:
    """Write ``data`` to ``rank``'s PMI connection (after any earlier Send to it)."""

    rank: int
    data: bytes

    def __post_init__(self) -> None:
        _check_rank(self.rank)


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort:
    """The rank called PMI abort. No reply is sent: the client blocks until it is killed."""

    rank: int
    code: int
    message: str

    def __post_init__(self) -> None:
        _check_rank(self.rank)


@dataclass(frozen=True, slots=True, kw_only=True)
class Finalized:
    """The rank finalized PMI; its reply is in a Send just before this event."""

    rank: int

    def __post_init__(self) -> None:
        _check_rank(self.rank)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProtocolError:
    """The rank's stream cannot be parsed; its further input is ignored. Fail the step."""

    rank: int
    message: str

    def __post_init__(self) -> None:
        _check_rank(self.rank)


@dataclass(frozen=True, slots=True, kw_only=True)
class Broken:
    """A collective or held request can never complete because ``rank`` can no longer take part.

    Emitted at most once per server, and never after another failure was recorded.
    """

    rank: int
    message: str

    def __post_init__(self) -> None:
        _check_rank(self.rank)


Output: TypeAlias = Send | Abort | Finalized | ProtocolError | Broken


class Protocol(enum.Enum):
    PMI1 = "PMI-1"
    PMI2 = "PMI-2"


# ---- per-rank and per-request state -------------------------------------------------------------


class _Wire(enum.Enum):
    LINES = "lines"  # PMI-1 framing, also the PMI-2 version handshake
    FRAMES = "frames"  # PMI-2 length-prefixed framing


class _StreamError(Exception):
    """The rank's stream is unusable from here on (becomes a ProtocolError)."""


class _Refused(Exception):
    """The peer's request is wrong; answer it with an error reply and carry on."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True, slots=True)
class _Request:
    rank: int
    wire: _Wire
    cmd: str
    args: dict[str, str]


@dataclass(frozen=True, slots=True)
class _Overlong:
    """A PMI-1 line past MAX_LINE_V1 that was dropped; ``head`` names its command, if any."""

    head: bytes
    length: int


@dataclass(slots=True)
class _Rank:
    rank: int
    buffer: bytearray = field(default_factory=bytearray)
    wire: _Wire = _Wire.LINES
    protocol: Protocol | None = None
    received: int = 0  # bytes fed so far
    messages: int = 0  # messages taken off the stream so far
    initialized: bool = False  # PMI-1 init (or PMI-2's version handshake) answered
    fullinit: bool = False
    finalized: bool = False
    aborted: bool = False
    exited: bool = False
    exit_ok: bool | None = None
    dead: bool = False  # after a ProtocolError: input is ignored
    dropping: int = 0  # bytes of an over-long PMI-1 line discarded so far
    dropped_head: bytes = b""
    block: list[bytes] | None = None  # lines of a PMI-1 "mcmd=spawn" block being collected
    block_bytes: int = 0

    @property
    def connected(self) -> bool:
        return self.received > 0

    @property
    def can_join(self) -> bool:
        """Could this rank still enter a barrier/fence (or put a node attribute)?"""
        return not (self.exited or self.finalized or self.dead)


#: PMI-1 request -> (reply command, whether that reply carries rc). MPICH's client does not
#: read rc from the rc-less replies (barrier_out, finalize_ack, ...), so refusing one of those
#: under its own name would look like success; such refusals are sent as ``cmd=error``.
_V1_REPLY: dict[str, tuple[str, bool]] = {
    "init": ("response_to_init", True),
    "get_maxes": ("maxes", False),
    "get_appnum": ("appnum", False),
    "get_my_kvsname": ("my_kvsname", False),
    "get_universe_size": ("universe_size", False),
    "put": ("put_result", True),
    "get": ("get_result", True),
    "barrier_in": ("barrier_out", False),
    "finalize": ("finalize_ack", False),
    "publish_name": ("publish_result", True),
    "unpublish_name": ("unpublish_result", True),
    "lookup_name": ("lookup_result", True),
    "spawn": ("spawn_result", True),
}


def _int(text: str | None) -> int | None:
    if text is None or not re.fullmatch(r"[+-]?[0-9]{1,18}", text.strip()):
        return None
    return int(text)


# ---- the server ---------------------------------------------------------------------------------


class PmiServer:
    """The PMI server of one step: ``size`` ranks, one KVS, one barrier/fence sequence."""

    def __init__(
        self,
        *,
        size: int,
        jobid: str,
        kvsname: str,
        appnum: int = 0,
        universe_size: int | None = None,
        process_mapping: str | None = None,
        max_value: int = 1024,
        max_key: int = 64,
        spawner_jobid: str | None = None,
        max_store_bytes: int = DEFAULT_MAX_STORE_BYTES,
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        names = {"jobid": jobid, "kvsname": kvsname, "spawner_jobid": spawner_jobid}
        for what, name in names.items():
            if name is not None and not (_SAFE_NAME.fullmatch(name) and len(name) <= MAX_KVSNAME):
                raise ValueError(f"{what} must be 1-{MAX_KVSNAME} of [A-Za-z0-9_.:+-]: {name!r}")
        if universe_size is None:
            universe_size = size
        if process_mapping is None:
            # MPICH's format: (vector,(first node, node count, ranks per node)): all on node 0.
            process_mapping = f"(vector,(0,1,{size}))"
        if any(c in process_mapping for c in " \n;"):
            raise ValueError(f"process_mapping has a space, newline or ';': {process_mapping!r}")
        if appnum < 0 or universe_size < 1 or max_value < 1 or max_key < 1:
            raise ValueError("appnum must be >= 0; universe_size, max_value and max_key >= 1")
        self.size = size
        self.jobid = jobid
        self.kvsname = kvsname
        self.appnum = appnum
        self.universe_size = universe_size
        self.max_value = max_value
        self.max_key = max_key
        self.spawner_jobid = spawner_jobid
        self.max_store_bytes = max_store_bytes

        self._ranks = [_Rank(rank) for rank in range(size)]
        # Server-provided keys, read by PMI-1 get and PMI-2 info-getjobattr alike (MPICH's
        # PMI-2 path asks info-getjobattr for "universeSize"). Not charged to the budget.
        self._kvs: dict[str, str] = {
            "PMI_process_mapping": process_mapping,
            "universeSize": str(universe_size),
        }
        self._staged: dict[str, str] = {}  # PMI-2 puts, visible after the next fence
        self._node_attrs: dict[str, str] = {}
        self._names: dict[str, str] = {}
        self._store_bytes = 0
        self._epoch = 0  # collectives completed
        self._waiting: dict[int, Send] = {}  # rank -> its release, prebuilt in its framing
        self._node_waits: dict[str, list[_Request]] = {}
        self._failure: str | None = None

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
                item = self._next_item(st)
                if item is None:
                    break
                out.extend(self._handle(st, item))
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
        self._drop_node_waits(rank)
        how = "exited with success" if status_ok else "failed"
        if st.connected and not st.finalized and not st.dead:
            still_need = [r.rank for r in self._ranks if r is not st and r.can_join]
            if still_need:
                return self._break(
                    rank,
                    f"rank {rank} {how} after connecting to PMI but without PMI finalize, while "
                    f"ranks {_ranks(still_need)} still need it for every later barrier/fence; "
                    "ending the step now instead of letting them hang",
                )
        return self._check_stuck(rank)

    def step_failing(self, reason: str) -> None:
        """The supervisor is ending the step for ``reason`` (a rank failed outside PMI) and is
        about to kill the other ranks: their deaths are its doing, not PMI failures, so nothing
        they cause is reported as the step's cause (the first failure's story is told)."""
        if self._failure is None:
            self._failure = reason

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

    # ---- framing --------------------------------------------------------------------------------

    def _rank(self, rank: int) -> _Rank:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside this step's 0..{self.size - 1}")
        return self._ranks[rank]

    def _next_item(self, st: _Rank) -> _Request | _Overlong | None:
        """Take the next complete message off the rank's buffer, if there is one."""
        while True:
            if st.wire is _Wire.FRAMES:
                body = self._take_frame(st)
                if body is None:
                    return None
                st.messages += 1
                cmd, args = parse_frame(body)
                return _Request(st.rank, _Wire.FRAMES, cmd, args)
            line = self._take_line(st)
            if line is None:
                return None
            st.messages += 1
            if isinstance(line, _Overlong):
                if st.block is not None:
                    raise _StreamError(f"a {line.length}-byte line inside a PMI-1 spawn block")
                return line
            if st.block is not None or line.startswith(b"mcmd="):
                request = self._collect_block(st, line)
                if request is None:
                    continue  # the block goes on
                return request
            cmd, args = parse_line(line)
            return _Request(st.rank, _Wire.LINES, cmd, args)

    def _take_line(self, st: _Rank) -> bytes | _Overlong | None:
        buf = st.buffer
        newline = buf.find(b"\n")
        if st.dropping:  # still inside an over-long line: discard up to its newline
            if newline < 0:
                st.dropping += len(buf)
                buf.clear()
                self._check_absurd(st.dropping + 1)
                return None
            length = st.dropping + newline + 1
            del buf[: newline + 1]
            head, st.dropping, st.dropped_head = st.dropped_head, 0, b""
            self._check_absurd(length)
            return _Overlong(head, length)
        if newline < 0:
            if len(buf) >= MAX_LINE_V1:  # cannot end within the limit any more: stop buffering
                st.dropped_head, st.dropping = bytes(buf[:_HEAD_LEN]), len(buf)
                buf.clear()
                self._check_absurd(st.dropping + 1)
            return None
        if newline + 1 > MAX_LINE_V1:
            self._check_absurd(newline + 1)
            head = bytes(buf[:_HEAD_LEN])
            del buf[: newline + 1]
            return _Overlong(head, newline + 1)
        line = bytes(buf[:newline])
        del buf[: newline + 1]
        return line

    @staticmethod
    def _check_absurd(length: int) -> None:
        # The message must not depend on how the bytes were split, so it names no byte count.
        if length > ABSURD_LINE_V1:
            raise _StreamError(f"a PMI-1 line longer than {ABSURD_LINE_V1} bytes: this is not PMI")

    @staticmethod
    def _take_frame(st: _Rank) -> bytes | None:
        buf = st.buffer
        if len(buf) < V2_HEADER_LEN:
            return None
        header = bytes(buf[:V2_HEADER_LEN])
        if not V2_HEADER.fullmatch(header):
            raise _StreamError(f"expected a 6-character PMI-2 length prefix, got {header!r}")
        length = int(header)
        if not 0 < length <= MAX_COMMAND_V2:
            raise _StreamError(f"PMI-2 command length {length} is outside 1..{MAX_COMMAND_V2}")
        if len(buf) < V2_HEADER_LEN + length:
            return None
        body = bytes(buf[V2_HEADER_LEN : V2_HEADER_LEN + length])
        del buf[: V2_HEADER_LEN + length]
        return body

    @staticmethod
    def _collect_block(st: _Rank, line: bytes) -> _Request | None:
        """PMI-1 spawn: ``mcmd=spawn``, then ``k=v`` lines (values may hold spaces), ``endcmd``."""
        if st.block is None:
            st.block, st.block_bytes = [], 0
        st.block.append(line)
        st.block_bytes += len(line) + 1
        if st.block_bytes > ABSURD_LINE_V1:
            raise _StreamError(f"a PMI-1 mcmd block longer than {ABSURD_LINE_V1} bytes")
        if line.strip() != b"endcmd":
            return None
        lines, st.block = st.block, None
        args: dict[str, str] = {}
        for raw in lines[1:-1]:
            key, eq, value = raw.decode("latin-1").partition("=")
            if not eq or not key:
                raise PmiSyntaxError(f"expected key=value in an mcmd block, got {preview(key)}")
            args.setdefault(key, value)
        return _Request(st.rank, _Wire.LINES, lines[0].decode("latin-1")[5:], args)

    # ---- dispatch and replies -------------------------------------------------------------------

    def _handle(self, st: _Rank, item: _Request | _Overlong) -> list[Output]:
        if isinstance(item, _Overlong):
            found = re.match(rb" *cmd=([^ \n]+)", item.head)
            cmd = found.group(1).decode("latin-1") if found else ""
            request = _Request(st.rank, _Wire.LINES, cmd, {})
            limit = f"a {item.length}-byte line exceeds the {MAX_LINE_V1}-byte PMI-1 limit"
            return [self._refusal(request, limit)]
        if st.protocol is None and item.cmd != "init":
            st.protocol = Protocol.PMI1 if item.wire is _Wire.LINES else Protocol.PMI2
        table = pmi_commands.V1_HANDLERS if item.wire is _Wire.LINES else pmi_commands.V2_HANDLERS
        handler = table.get(item.cmd)
        if handler is None:
            protocol = "PMI-1" if item.wire is _Wire.LINES else "PMI-2"
            return [self._refusal(item, f"unknown {protocol} command {preview(item.cmd)}")]
        try:
            return handler(self, st, item)
        except _Refused as exc:
            return [self._refusal(item, exc.message)]

    @staticmethod
    def _reply_name(req: _Request, refusing: bool = False) -> str:
        if req.wire is _Wire.FRAMES:
            return f"{req.cmd}-response"
        name, has_rc = _V1_REPLY.get(req.cmd, ("error", True))
        return "error" if refusing and not has_rc else name

    def _send(self, req: _Request, pairs: Sequence[tuple[str, str]]) -> Send:
        """A reply to ``req`` in the framing it came in."""
        name = self._reply_name(req)
        if req.wire is _Wire.FRAMES:
            thrid = req.args.get("thrid")
            echoed = [("thrid", thrid), *pairs] if thrid is not None else list(pairs)
            return Send(rank=req.rank, data=encode_frame(name, echoed))
        try:
            return Send(rank=req.rank, data=encode_line(name, pairs))
        except Unencodable as exc:
            return self._refusal(req, f"the reply cannot be sent over PMI-1: {exc}")

    def _ok(self, req: _Request, *pairs: tuple[str, str]) -> Send:
        """A PMI-2 success reply: rc=0 comes last, as Hydra sends it."""
        return self._send(req, [*pairs, ("rc", "0")])

    def _refusal(self, req: _Request, message: str) -> Send:
        name = self._reply_name(req, refusing=True)
        if req.wire is _Wire.FRAMES:
            return self._send(req, [("rc", "-1"), ("errmsg", message)])
        # PMI-1 values cannot hold spaces; Hydra words its messages the same way.
        word = "_".join(message.split()) or "error"
        return Send(rank=req.rank, data=encode_line(name, [("rc", "-1"), ("msg", word[:512])]))

    # ---- failure bookkeeping --------------------------------------------------------------------

    def _stream_failed(self, st: _Rank, message: str) -> list[Output]:
        st.dead = True
        st.buffer.clear()
        st.block = None
        self._drop_node_waits(st.rank)
        text = f"rank {st.rank} sent bytes that are not PMI ({message}); its stream is abandoned"
        if self._failure is None:
            self._failure = text
        return [ProtocolError(rank=st.rank, message=text)]

    def _break(self, rank: int, message: str) -> list[Output]:
        if self._failure is not None:  # the step is already failing; its story is told
            return []
        self._failure = message
        return [Broken(rank=rank, message=message)]

    def _check_stuck(self, culprit: int) -> list[Output]:
        """Broken if a waiting collective or a held nodeattr request can never be answered."""
        if self._waiting:
            gone = [
                st.rank for st in self._ranks if st.rank not in self._waiting and not st.can_join
            ]
            if gone:
                rank = culprit if culprit in gone else gone[0]
                return self._break(
                    rank,
                    f"rank {rank} {self._whereabouts(rank)}, but ranks {_ranks(self._waiting)} "
                    f"wait in barrier/fence #{self._epoch + 1}, which needs all {self.size} ranks "
                    "and so can never complete; ending the step",
                )
        if self._node_waits:
            holders = {req.rank for reqs in self._node_waits.values() for req in reqs}
            if not any(st.can_join and st.rank not in holders for st in self._ranks):
                keys = ", ".join(sorted(self._node_waits))
                return self._break(
                    culprit,
                    f"ranks {_ranks(holders)} wait for node attribute(s) {keys} that no remaining "
                    f"rank can put (rank {culprit} {self._whereabouts(culprit)}); ending the step",
                )
        return []

    def _whereabouts(self, rank: int) -> str:
        st = self._ranks[rank]
        if st.exited:
            ended = "exited with success" if st.exit_ok else "failed"
            return f"{ended}{'' if st.connected else ' without ever connecting to PMI'}"
        if st.finalized:
            return "has finalized PMI"
        if st.dead:
            return "broke its PMI stream"
        return "is still running"

    def _drop_node_waits(self, rank: int) -> None:
        for key in list(self._node_waits):
            kept = [req for req in self._node_waits[key] if req.rank != rank]
            if kept:
                self._node_waits[key] = kept
            else:
                del self._node_waits[key]

    # ---- shared operations ----------------------------------------------------------------------

    @staticmethod
    def _arg(req: _Request, name: str) -> str:
        value = req.args.get(name)
        if value is None:
            raise _Refused(f"{req.cmd} needs {name}=")
        return value

    def _key(self, req: _Request, name: str = "key") -> str:
        key = self._arg(req, name)
        if not key:
            raise _Refused(f"{req.cmd}: {name} must not be empty")
        if len(key) > self.max_key:
            raise _Refused(
                f"{req.cmd}: {name} of {len(key)} bytes exceeds keylen_max={self.max_key}"
            )
        return key

    def _value(self, req: _Request, name: str = "value") -> str:
        value = self._arg(req, name)
        if len(value) > self.max_value:
            raise _Refused(
                f"{req.cmd}: {name} of {len(value)} bytes exceeds vallen_max={self.max_value}"
            )
        return value

    def _check_kvsname(self, req: _Request) -> None:
        name = req.args.get("kvsname")
        if name is not None and name != self.kvsname:
            raise _Refused(f"kvsname {preview(name)} is not this job's ({self.kvsname})")

    def _store(
        self, table: dict[str, str], key: str, value: str, old: str | None, what: str
    ) -> None:
        """Insert once. PMI keys are write-once; an identical re-put is accepted as a retry."""
        if old is not None:
            if old != value:
                raise _Refused(f"{what} key {preview(key)} was already put with another value")
            return
        if self._store_bytes + len(key) + len(value) > self.max_store_bytes:
            raise _Refused(f"the step's PMI store is full ({self.max_store_bytes} bytes)")
        self._store_bytes += len(key) + len(value)
        table[key] = value

    def _put_kvs(self, key: str, value: str, *, staged: bool) -> None:
        old = self._kvs.get(key, self._staged.get(key))
        self._store(self._staged if staged else self._kvs, key, value, old, "KVS")

    def _enter_collective(self, st: _Rank, release: Send) -> list[Output]:
        if st.rank in self._waiting:
            # The client blocks in this call, so a second entry means its stream is confused.
            raise _StreamError(f"entered barrier/fence #{self._epoch + 1} twice")
        if st.finalized:
            raise _Refused("barrier/fence after finalize")
        if st.exited:  # late bytes from a dead rank: it cannot be released, so it is not in
            return self._check_stuck(st.rank)
        self._waiting[st.rank] = release
        if len(self._waiting) < self.size:
            return self._check_stuck(st.rank)
        # Everyone is in: staged PMI-2 puts become visible, then everyone is released at once.
        self._kvs.update(self._staged)
        self._staged.clear()
        self._epoch += 1
        released = [self._waiting[rank] for rank in sorted(self._waiting)]
        self._waiting.clear()
        return list(released)

    def _finalize(self, st: _Rank, reply: Send) -> list[Output]:
        if st.finalized:
            raise _Refused("PMI finalize was already done on this connection")
        st.finalized = True
        return [reply, Finalized(rank=st.rank), *self._check_stuck(st.rank)]

    def _abort(self, st: _Rank, code_text: str | None, message: str) -> list[Output]:
        code = _int(code_text)
        code = 1 if code is None else code
        st.aborted = True
        if self._failure is None:
            self._failure = f"rank {st.rank} called PMI abort with exit code {code}: {message}"
        return [Abort(rank=st.rank, code=code, message=message)]

    def _publish(self, name: str, port: str) -> None:
        self._store(self._names, name, port, self._names.get(name), "published name")

    def _unpublish(self, name: str) -> None:
        if self._names.pop(name, None) is None:
            raise _Refused(f"service {preview(name)} is not published")

    def _lookup(self, name: str) -> str:
        port = self._names.get(name)
        if port is None:
            raise _Refused(f"service {preview(name)} is not published")
        return port


def _ranks(ranks: Any) -> str:
    return "[" + ", ".join(str(r) for r in sorted(ranks)) + "]"


# The commands need this module's classes, so they are imported last (a cycle Python resolves
# either way round: nothing here uses them before a request arrives).
from tether.supervisor import pmi_commands  # noqa: E402
