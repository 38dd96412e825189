"""The verbs that read what a step wrote and what happened to it: ``output`` (the last lines, or
followed from an offset) and ``events`` (the step's event log from an index), for its owner.

Why a module of its own: these verbs and the results they build are shared with the parts of
the supervisor that answer them later: a parked follower is answered by follow.py with
``follow_result`` and ``events_result`` once there is news (``has_news``), and recording.py
keeps the final ``stream_sizes`` so that a follower knows it has read everything. Output is read
only through the read-only fds opened at launch (``launcher.readers``). The table, who may call
each verb and the verbs that act on the step are in handlers.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tether.shared import protocol
from tether.shared.errors import BadRequest, StateError
from tether.shared.protocol import arg_int, arg_number, arg_str, check_known
from tether.supervisor import introspect
from tether.supervisor.machine_events import (
    Act,
    FollowEvents,
    FollowOutput,
    StreamAnswered,
)
from tether.supervisor.state import PENDING, Peer, SupervisorState
from tether.supervisor.step import Phase

STREAMS = ("stdout", "stderr")
#: Largest byte offset a follower may name (files are never that big; msgpack ints are 64-bit).
MAX_OFFSET = 1 << 62
#: Most events in one ``events`` reply; the follower asks again for the rest.
EVENTS_MAX = 1000
#: ``output`` without ``offset``: the last this many lines, unless ``lines`` says otherwise.
DEFAULT_LINES = 10
MAX_LINES = 1_000_000
MAX_HOLD_ARG = 3600.0
ENDED = (Phase.EXITED, Phase.ABORTED)


def _selected(sup: SupervisorState, which: str) -> tuple[str, ...]:
    """The streams a request names; ``both`` is one stream when both go to one file."""
    if which == "both":
        return ("stdout",) if sup.spec["output"] == sup.spec["error"] else STREAMS
    return (which,)


def _reader(sup: SupervisorState, name: str) -> int | None:
    fd = sup.launcher.readers.get(name)
    if fd is None and sup.step.phase not in (Phase.READY, Phase.ABORTED) and (
            any(t.pid for t in sup.step.tasks)):
        raise StateError(f"the {name} of step {sup.rd.job}.{sup.rd.attempt} cannot be read "
                         "(the supervisor could not open it at launch)")
    return fd


def stream_sizes(sup: SupervisorState) -> dict[str, int]:
    sizes = {}
    for name in STREAMS:
        fd = sup.launcher.readers.get(name)
        sizes[name] = introspect.fd_size(fd) if fd is not None else 0
    return sizes


def follow_result(sup: SupervisorState, streams: tuple[str, ...],
                  offsets: Mapping[str, int]) -> dict[str, Any]:
    """New bytes of each stream from its offset (at most FOLLOW_MAX each), and ``ended``."""
    res: dict[str, Any] = {"phase": sup.step.phase.value}
    complete = True
    final = sup.final_sizes or {}
    for name in streams:
        fd = _reader(sup, name)
        off = offsets.get(name, 0)
        size = introspect.fd_size(fd) if fd is not None else 0
        if off > size:
            raise BadRequest(f"offset {off} is past the end of {name} ({size} bytes)")
        data = b""
        if fd is not None and off < size:
            data = introspect.read_span(introspect.fd_reader(fd), off, size,
                                        introspect.FOLLOW_MAX)
        res[name] = {"data": data, "offset": off + len(data), "size": size}
        if off + len(data) < final.get(name, 0):
            complete = False
    res["ended"] = sup.step.phase in ENDED and sup.final_sizes is not None and complete
    return res


def has_news(res: Mapping[str, Any]) -> bool:
    return bool(res["ended"]) or any(
        res[name]["data"] for name in STREAMS if name in res)


def _offsets(value: Any, streams: tuple[str, ...]) -> dict[str, int]:
    if not isinstance(value, dict):
        raise BadRequest("argument 'offset' must be a map of stream name to byte offset")
    offsets = {}
    for name in value:
        if name not in streams:
            raise BadRequest(f"argument 'offset' names {name!r}, which is not one of the "
                             f"streams asked for ({', '.join(streams)})")
        offsets[name] = arg_int(value, name, minimum=0, maximum=MAX_OFFSET)
    return offsets


def output(sup: SupervisorState, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("stream", "lines", "offset", "hold"))
    which = arg_str(req.args, "stream", default="both")
    if which not in (*STREAMS, "both"):
        raise BadRequest(f"argument 'stream' must be stdout, stderr or both, not {which!r}")
    streams = _selected(sup, which)
    if "offset" in req.args:
        if "lines" in req.args:
            raise BadRequest("'lines' (the last lines) and 'offset' (follow) exclude each other")
        offsets = _offsets(req.args["offset"], streams)
        hold = arg_number(req.args, "hold", default=0.0, maximum=MAX_HOLD_ARG)
        res = follow_result(sup, streams, offsets)
        if hold > 0 and not has_news(res):
            return Act((FollowOutput(peer=peer, rid=req.id, streams=streams, offsets=offsets,
                                     hold=hold),), PENDING)
        return Act((StreamAnswered(peer=peer, verb="output", ended=bool(res["ended"])),), res)
    if "hold" in req.args:
        raise BadRequest("'hold' needs 'offset' (follow mode)")
    lines = arg_int(req.args, "lines", default=DEFAULT_LINES, minimum=0, maximum=MAX_LINES)
    res = {"phase": sup.step.phase.value}
    for name in streams:
        fd = _reader(sup, name)
        if fd is None:
            res[name] = {"data": b"", "offset": 0, "size": 0, "truncated": False}
            continue
        read = introspect.fd_reader(fd)
        size = introspect.fd_size(fd)
        start, truncated = introspect.tail_start(read, size, lines)
        data = introspect.read_span(read, start, size, introspect.TAIL_MAX)
        res[name] = {"data": data, "offset": start, "size": size, "truncated": truncated}
    return res


def events_result(sup: SupervisorState, after: int) -> dict[str, Any]:
    batch = sup.events[after:after + EVENTS_MAX]
    last = after + len(batch)
    return {"events": batch, "last": last,
            "ended": sup.step.phase in ENDED and last == len(sup.events)}


def events(sup: SupervisorState, peer: Peer, req: protocol.Request) -> Any:
    check_known(req.args, req.kind, ("after", "hold"))
    after = arg_int(req.args, "after", default=0, minimum=0, maximum=MAX_OFFSET)
    if after > len(sup.events):
        raise BadRequest(f"argument 'after' is {after}, past the last event "
                         f"({len(sup.events)})")
    hold = arg_number(req.args, "hold", default=0.0, maximum=MAX_HOLD_ARG)
    res = events_result(sup, after)
    if hold > 0 and not res["events"] and not res["ended"]:
        return Act((FollowEvents(peer=peer, rid=req.id, after=after, hold=hold),), PENDING)
    return Act((StreamAnswered(peer=peer, verb="events", ended=bool(res["ended"])),), res)
