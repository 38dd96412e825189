"""The step, its PMI server and its machine as plain data, for an upgrade's hand-over. Pure.

handover.py encodes what these functions return (msgpack) and decodes it in the new image.

Why plain data and not a pickle of the objects: a pickle ties the image that reads it to the
classes of the image that wrote it (their module paths, their fields, slots or not), so any
refactoring of step.py or pmi*.py broke the hand-over between two releases. These dicts name
every field; a field a later release adds gets its default when an older image did not write it,
and msgpack carries them (bytes stay bytes; maps may have integer keys).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from tether.supervisor import machine
from tether.supervisor.pmi import PmiServer
from tether.supervisor.pmi_state import Protocol, Send, _Rank, _Request, _Wire
from tether.supervisor.step import Phase, Step, Task

_TASK_FIELDS = tuple(f.name for f in fields(Task))
_STEP_SCALARS = ("job", "attempt", "ntasks", "cancelled", "timed_out", "terminated_by",
                 "started_at", "ended_at", "abort_reason", "forced_reason", "forced_code",
                 "oom_mb", "launched_mono", "pmi_unused", "usage")


# ---- the step --------------------------------------------------------------------------------

def step_to_dict(step: Step) -> dict[str, Any]:
    out: dict[str, Any] = {k: getattr(step, k) for k in _STEP_SCALARS}
    out["phase"] = step.phase.value
    out["tasks"] = [{k: getattr(t, k) for k in _TASK_FIELDS} for t in step.tasks]
    out["first_failure"] = None if step.first_failure is None else step.first_failure.rank
    return out


def step_from_dict(d: dict[str, Any]) -> Step:
    tasks = [Task(**{k: v for k, v in t.items() if k in _TASK_FIELDS}) for t in d["tasks"]]
    step = Step(job=int(d["job"]), attempt=int(d["attempt"]), ntasks=int(d["ntasks"]),
                phase=Phase(d["phase"]), tasks=tasks)
    for k in _STEP_SCALARS[3:]:
        if k in d:
            setattr(step, k, d[k])
    ff = d.get("first_failure")
    step.first_failure = None if ff is None else tasks[int(ff)]
    return step


# ---- the machine -------------------------------------------------------------------------------

def machine_to_dict(m: machine.Machine) -> dict[str, Any]:
    return {"state": m.state.value, "phase": m.phase.value, "cancelled": m.cancelled,
            "timed_out": m.timed_out, "terminated_by": m.terminated_by, "durable": m.durable}


def machine_from_dict(d: dict[str, Any]) -> machine.Machine:
    return machine.Machine(state=machine.State(d["state"]), phase=Phase(d["phase"]),
                           cancelled=bool(d["cancelled"]), timed_out=bool(d["timed_out"]),
                           terminated_by=d["terminated_by"], durable=bool(d["durable"]))


# ---- the PMI server ------------------------------------------------------------------------------

_SERVER_SCALARS = ("size", "jobid", "kvsname", "appnum", "universe_size", "max_value", "max_key",
                   "spawner_jobid", "max_store_bytes", "_store_bytes", "_epoch", "_failure")
_SERVER_MAPS = ("_kvs", "_staged", "_node_attrs", "_names")
_RANK_FIELDS = tuple(f.name for f in fields(_Rank))


def _rank_to_dict(st: _Rank) -> dict[str, Any]:
    d = {k: getattr(st, k) for k in _RANK_FIELDS}
    d["buffer"] = bytes(st.buffer)
    d["wire"] = st.wire.value
    d["protocol"] = None if st.protocol is None else st.protocol.value
    return d


def _rank_from_dict(d: dict[str, Any]) -> _Rank:
    st = _Rank(int(d["rank"]))
    for k in _RANK_FIELDS:
        if k in d and k not in ("rank", "buffer", "wire", "protocol", "block"):
            setattr(st, k, d[k])
    st.buffer = bytearray(d.get("buffer", b""))
    st.wire = _Wire(d.get("wire", _Wire.LINES.value))
    st.protocol = None if d.get("protocol") is None else Protocol(d["protocol"])
    st.block = None if d.get("block") is None else [bytes(b) for b in d["block"]]
    return st


def _request_to_dict(r: _Request) -> dict[str, Any]:
    return {"rank": r.rank, "wire": r.wire.value, "cmd": r.cmd, "args": dict(r.args)}


def _request_from_dict(d: dict[str, Any]) -> _Request:
    return _Request(int(d["rank"]), _Wire(d["wire"]), str(d["cmd"]), dict(d["args"]))


def pmi_to_dict(srv: PmiServer) -> dict[str, Any]:
    d: dict[str, Any] = {k: getattr(srv, k) for k in _SERVER_SCALARS}
    for k in _SERVER_MAPS:
        d[k] = dict(getattr(srv, k))
    d["_ranks"] = [_rank_to_dict(st) for st in srv._ranks]
    d["_waiting"] = {rank: send.data for rank, send in srv._waiting.items()}
    d["_node_waits"] = {key: [_request_to_dict(r) for r in reqs]
                        for key, reqs in srv._node_waits.items()}
    return d


def pmi_from_dict(d: dict[str, Any]) -> PmiServer:
    """The server as it was, without running its constructor (its checks passed once)."""
    srv = PmiServer.__new__(PmiServer)
    for k in _SERVER_SCALARS:
        setattr(srv, k, d[k])
    for k in _SERVER_MAPS:
        setattr(srv, k, {str(a): str(b) for a, b in d[k].items()})
    srv._ranks = [_rank_from_dict(r) for r in d["_ranks"]]
    srv._waiting = {int(rank): Send(rank=int(rank), data=bytes(data))
                    for rank, data in d["_waiting"].items()}
    srv._node_waits = {str(key): [_request_from_dict(r) for r in reqs]
                       for key, reqs in d["_node_waits"].items()}
    return srv
