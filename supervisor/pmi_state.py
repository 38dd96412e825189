"""The PMI server's data (pmi.py): its limits, what it outputs, each rank's and request's state,
and ``PmiState``, the state of one step's server. Pure.

Apart from pmi.py so that the parts that act on it (pmi_framing.py, pmi_commands.py, pmi_kvs.py)
and the server that drives them (pmi.py's ``PmiServer``, a ``PmiState``) import this module and
not each other: no import cycle. pmi.py re-exports every name here.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import TypeAlias

# ---- limits -------------------------------------------------------------------------------------

#: kvsname_max advertised by get_maxes (Hydra's value); jobid and kvsname must fit in it.
MAX_KVSNAME = 256
#: Cap on the memory the KVS, node attributes and names hold together, each entry counted as its
#: key's and value's bytes plus ENTRY_OVERHEAD (what Python spends on two strings and a slot of
#: the table): it lives in the supervisor, a root process outside the step's memory limit, so a
#: rank must not grow it at will. Nothing is refunded. The agent's ``--pmi-store-mb`` sets it per
#: step (spec ``pmi_store_bytes``); this is its default.
DEFAULT_MAX_STORE_BYTES = 16 * 1024 * 1024
#: bytes one stored entry costs beyond its key and value (CPython 3.11, measured: ~136)
ENTRY_OVERHEAD = 160

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


def _int(text: str | None) -> int | None:
    if text is None or not re.fullmatch(r"[+-]?[0-9]{1,18}", text.strip()):
        return None
    return int(text)

# ---- the server ---------------------------------------------------------------------------------


class PmiState:
    """The state of one step's PMI server: ``size`` ranks, one KVS, one barrier/fence sequence
    (pmi.py's ``PmiServer`` drives it)."""

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
