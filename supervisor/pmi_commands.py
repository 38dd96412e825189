"""The PMI-1 and PMI-2 commands: what each request a rank sends does to its server, and how it
is answered.

Why a module of its own: the commands are the long, flat part of the PMI server (one function
per command, two dispatch tables, the argument checks and the replies in the framing a request
came in), while pmi.py keeps the state machine they act on (the ranks, the server's driving
API), pmi_framing.py takes the requests off a rank's stream and pmi_kvs.py holds the operations
on what ranks share (the store, collectives, failure bookkeeping). Each command is a function of
the server (``srv``), the sending rank's state and the request; it raises ``_Refused`` for an
error reply. The classes the handover pickles (pmi.py's ``PmiState``, ``_Rank``, ``Send``...)
stay in pmi.py, so that a pickle names the same classes before and after this split
(handover.FORMAT unchanged); pmi.py imports this module at its end, once those classes exist.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TypeAlias

from tether.supervisor import pmi_framing, pmi_kvs
from tether.supervisor.pmi_state import (
    MAX_KVSNAME,
    Output,
    PmiState,
    Protocol,
    Send,
    _int,
    _Rank,
    _Refused,
    _Request,
    _Wire,
)
from tether.supervisor.pmi_wire import MAX_LINE_V1, Unencodable, encode_frame, encode_line, preview

# ---- replies ------------------------------------------------------------------------------------

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


def _reply_name(req: _Request, refusing: bool = False) -> str:
    if req.wire is _Wire.FRAMES:
        return f"{req.cmd}-response"
    name, has_rc = _V1_REPLY.get(req.cmd, ("error", True))
    return "error" if refusing and not has_rc else name


def _reply(req: _Request, pairs: Sequence[tuple[str, str]]) -> Send:
    """A reply to ``req`` in the framing it came in."""
    name = _reply_name(req)
    if req.wire is _Wire.FRAMES:
        thrid = req.args.get("thrid")
        echoed = [("thrid", thrid), *pairs] if thrid is not None else list(pairs)
        return Send(rank=req.rank, data=encode_frame(name, echoed))
    try:
        return Send(rank=req.rank, data=encode_line(name, pairs))
    except Unencodable as exc:
        return _refusal(req, f"the reply cannot be sent over PMI-1: {exc}")


def _ok(req: _Request, *pairs: tuple[str, str]) -> Send:
    """A PMI-2 success reply: rc=0 comes last, as Hydra sends it."""
    return _reply(req, [*pairs, ("rc", "0")])


def _refusal(req: _Request, message: str) -> Send:
    name = _reply_name(req, refusing=True)
    if req.wire is _Wire.FRAMES:
        return _reply(req, [("rc", "-1"), ("errmsg", message)])
    # PMI-1 values cannot hold spaces; Hydra words its messages the same way.
    word = "_".join(message.split()) or "error"
    return Send(rank=req.rank, data=encode_line(name, [("rc", "-1"), ("msg", word[:512])]))


# ---- arguments ----------------------------------------------------------------------------------


def _arg(req: _Request, name: str) -> str:
    value = req.args.get(name)
    if value is None:
        raise _Refused(f"{req.cmd} needs {name}=")
    return value


def _key(srv: PmiState, req: _Request, name: str = "key") -> str:
    key = _arg(req, name)
    if not key:
        raise _Refused(f"{req.cmd}: {name} must not be empty")
    if len(key) > srv.max_key:
        raise _Refused(f"{req.cmd}: {name} of {len(key)} bytes exceeds keylen_max={srv.max_key}")
    return key


def _value(srv: PmiState, req: _Request, name: str = "value") -> str:
    value = _arg(req, name)
    if len(value) > srv.max_value:
        raise _Refused(
            f"{req.cmd}: {name} of {len(value)} bytes exceeds vallen_max={srv.max_value}"
        )
    return value


def _check_kvsname(srv: PmiState, req: _Request) -> None:
    name = req.args.get("kvsname")
    if name is not None and name != srv.kvsname:
        raise _Refused(f"kvsname {preview(name)} is not this job's ({srv.kvsname})")


# ---- PMI-1 commands -----------------------------------------------------------------------------


def _v1_init(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    if st.initialized:
        raise _Refused("PMI init was already done on this connection")
    version = req.args.get("pmi_version")
    if version == "1":
        # Answer subversion 1 so that newer clients don't send PMI-1.2 barrier groups.
        st.initialized, st.protocol = True, Protocol.PMI1
        return [_reply(req, [("pmi_version", "1"), ("pmi_subversion", "1"), ("rc", "0")])]
    if version == "2":
        st.initialized, st.protocol = True, Protocol.PMI2
        reply = _reply(req, [("pmi_version", "2"), ("pmi_subversion", "0"), ("rc", "0")])
        st.wire = _Wire.FRAMES  # every byte after this line is a PMI-2 frame
        return [reply]
    # rc is mandatory; MPICH prints the versions given here in its "version mismatch" error.
    message = f"unsupported_pmi_version_{version}"
    pairs = [("pmi_version", "1"), ("pmi_subversion", "1"), ("rc", "-1"), ("msg", message)]
    return [_reply(req, pairs)]

def _v1_get_maxes(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    return [_reply(req, [
        ("kvsname_max", str(MAX_KVSNAME)),
        ("keylen_max", str(srv.max_key)),
        ("vallen_max", str(srv.max_value)),
    ])]

def _v1_get_appnum(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    return [_reply(req, [("appnum", str(srv.appnum))])]

def _v1_get_my_kvsname(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    return [_reply(req, [("kvsname", srv.kvsname)])]

def _v1_get_universe_size(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    return [_reply(req, [("size", str(srv.universe_size))])]

def _v1_put(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    _check_kvsname(srv, req)
    pmi_kvs.put_kvs(srv, _key(srv, req), _value(srv, req), staged=False)
    return [_reply(req, [("rc", "0"), ("msg", "success")])]

def _v1_get(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    _check_kvsname(srv, req)
    key = _key(srv, req)
    value = srv._kvs.get(key)
    if value is None:
        raise _Refused(f"key {key} not found")
    return [_reply(req, [("rc", "0"), ("msg", "success"), ("value", value)])]

def _v1_barrier_in(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    return pmi_kvs.enter_collective(srv, st, _reply(req, []))

def _v1_finalize(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    return pmi_kvs.finalize(srv, st, _reply(req, []))

def _v1_abort(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    return pmi_kvs.abort(srv, st, req.args.get("exitcode"), req.args.get("message", ""))

def _v1_publish_name(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    pmi_kvs.publish(srv, _key(srv, req, "service"), _value(srv, req, "port"))
    return [_reply(req, [("rc", "0")])]

def _v1_unpublish_name(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    pmi_kvs.unpublish(srv, _key(srv, req, "service"))
    return [_reply(req, [("rc", "0")])]

def _v1_lookup_name(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    return [_reply(req, [("rc", "0"), ("port", pmi_kvs.lookup(srv, _key(srv, req, "service")))])]

def _v1_spawn(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    # MPICH sends one mcmd block per command and reads one spawn_result after the last
    # (spawnssofar == totspawns); answering each block would desynchronize its stream.
    total, so_far = _int(req.args.get("totspawns")), _int(req.args.get("spawnssofar"))
    if total is not None and so_far is not None and 0 < so_far < total:
        return []
    raise _Refused("spawn is not supported by this launcher")


# ---- PMI-2 commands -----------------------------------------------------------------------------


def _v2_fullinit(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    if st.fullinit:
        raise _Refused("fullinit was already done on this connection")
    # MPICH sends pmirank ($PMI_ID or $PMI_RANK); Slurm's libpmi2 sends srcid=$PMI_ID.
    # A mismatch means the rank inherited another launcher's PMI_* environment.
    for name in ("pmirank", "srcid"):
        claimed = req.args.get(name)
        if claimed is not None and _int(claimed) != st.rank:
            raise _Refused(f"fullinit says {name}={claimed}, but this is rank {st.rank}'s fd")
    jobid = req.args.get("pmijobid")
    if jobid is not None and jobid != srv.jobid:
        raise _Refused(f"fullinit says pmijobid={jobid}, but this is job {srv.jobid}")
    st.fullinit, st.protocol = True, Protocol.PMI2
    pairs = [
        ("pmi-version", "2"),
        ("pmi-subversion", "0"),
        ("rank", str(st.rank)),
        ("size", str(srv.size)),
        ("appnum", str(srv.appnum)),
    ]
    if srv.spawner_jobid is not None:  # its mere presence tells MPI it was spawned
        pairs.append(("spawner-jobid", srv.spawner_jobid))
    pairs += [("debugged", "FALSE"), ("pmiverbose", "FALSE")]
    return [_ok(req, *pairs)]

def _v2_job_getid(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    return [_ok(req, ("jobid", srv.jobid))]

def _v2_kvs_put(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    pmi_kvs.put_kvs(srv, _key(srv, req), _value(srv, req), staged=True)
    return [_ok(req)]

def _v2_kvs_fence(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    return pmi_kvs.enter_collective(srv, st, _ok(req))

def _v2_kvs_get(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    jobid = req.args.get("jobid")
    if jobid and jobid != srv.jobid:
        raise _Refused(f"kvs-get for job {preview(jobid)}: only job {srv.jobid} is here")
    value = srv._kvs.get(_key(srv, req))  # srcid is only a hint; the KVS is flat
    return [_found(req, value)]

def _v2_info_getjobattr(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    return [_found(req, srv._kvs.get(_key(srv, req)))]

def _v2_info_putnodeattr(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    key, value = _key(srv, req), _value(srv, req)
    pmi_kvs.store(srv, srv._node_attrs, key, value, srv._node_attrs.get(key), "node attribute")
    out: list[Output] = [_ok(req)]
    # Answer the requests held for this key, in arrival order.
    out += [_found(held, value) for held in srv._node_waits.pop(key, [])]
    return out

def _v2_info_getnodeattr(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    key = _key(srv, req)
    wait = req.args.get("wait", "FALSE")
    if wait not in ("TRUE", "FALSE"):
        raise _Refused(f"wait must be TRUE or FALSE, got {preview(wait)}")
    value = srv._node_attrs.get(key)
    if value is not None or wait == "FALSE":
        return [_found(req, value)]
    if st.exited:  # late bytes from a dead rank: nobody would read the answer
        return []
    srv._node_waits.setdefault(key, []).append(req)
    return pmi_kvs.check_stuck(srv, st.rank)

def _found(req: _Request, value: str | None) -> Send:
    if value is None:
        return _ok(req, ("found", "FALSE"))
    return _ok(req, ("found", "TRUE"), ("value", value))

def _v2_name_publish(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    pmi_kvs.publish(srv, _key(srv, req, "name"), _value(srv, req, "port"))
    return [_ok(req)]

def _v2_name_unpublish(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    pmi_kvs.unpublish(srv, _key(srv, req, "name"))
    return [_ok(req)]

def _v2_name_lookup(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    return [_ok(req, ("port", pmi_kvs.lookup(srv, _key(srv, req, "name"))))]

def _v2_finalize(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    return pmi_kvs.finalize(srv, st, _ok(req))

def _v2_abort(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    # Old clients send isworld= and msg=; the PMI-2 spec (and MPICH >= 4.2) exitcode= and
    # message=.
    message = req.args.get("message", req.args.get("msg", ""))
    return pmi_kvs.abort(srv, st, req.args.get("exitcode"), message)

def _v2_spawn(srv: PmiState, st: _Rank, req: _Request) -> list[Output]:
    raise _Refused("spawn is not supported by this launcher")


#: A command's handler: the server, the rank that sent it, the request; what to do.
Handler: TypeAlias = Callable[[PmiState, _Rank, _Request], list[Output]]

#: PMI-1 commands (line framing). Anything else gets an error reply.
V1_HANDLERS: dict[str, Handler] = {
    "init": _v1_init,
    "get_maxes": _v1_get_maxes,
    "get_appnum": _v1_get_appnum,
    "get_my_kvsname": _v1_get_my_kvsname,
    "get_universe_size": _v1_get_universe_size,
    "put": _v1_put,
    "get": _v1_get,
    "barrier_in": _v1_barrier_in,
    "finalize": _v1_finalize,
    "abort": _v1_abort,
    "publish_name": _v1_publish_name,
    "unpublish_name": _v1_unpublish_name,
    "lookup_name": _v1_lookup_name,
    "spawn": _v1_spawn,
}

#: PMI-2 commands (frame framing). Replies are always ``<cmd>-response``.
V2_HANDLERS: dict[str, Handler] = {
    "fullinit": _v2_fullinit,
    "job-getid": _v2_job_getid,
    "kvs-put": _v2_kvs_put,
    "kvs-fence": _v2_kvs_fence,
    "kvs-get": _v2_kvs_get,
    "info-getjobattr": _v2_info_getjobattr,
    "info-putnodeattr": _v2_info_putnodeattr,
    "info-getnodeattr": _v2_info_getnodeattr,
    "name-publish": _v2_name_publish,
    "name-unpublish": _v2_name_unpublish,
    "name-lookup": _v2_name_lookup,
    "finalize": _v2_finalize,
    "abort": _v2_abort,
    "spawn": _v2_spawn,
}


# ---- dispatch -----------------------------------------------------------------------------------


def handle(srv: PmiState, st: _Rank, item: _Request | pmi_framing.Overlong) -> list[Output]:
    """What one message from ``st``'s stream does: its command's outputs, or an error reply."""
    if isinstance(item, pmi_framing.Overlong):
        found = re.match(rb" *cmd=([^ \n]+)", item.head)
        cmd = found.group(1).decode("latin-1") if found else ""
        request = _Request(st.rank, _Wire.LINES, cmd, {})
        limit = f"a {item.length}-byte line exceeds the {MAX_LINE_V1}-byte PMI-1 limit"
        return [_refusal(request, limit)]
    if st.protocol is None and item.cmd != "init":
        st.protocol = Protocol.PMI1 if item.wire is _Wire.LINES else Protocol.PMI2
    table = V1_HANDLERS if item.wire is _Wire.LINES else V2_HANDLERS
    handler = table.get(item.cmd)
    if handler is None:
        protocol = "PMI-1" if item.wire is _Wire.LINES else "PMI-2"
        return [_refusal(item, f"unknown {protocol} command {preview(item.cmd)}")]
    try:
        return handler(srv, st, item)
    except _Refused as exc:
        return [_refusal(item, exc.message)]
