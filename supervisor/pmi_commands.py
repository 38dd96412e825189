"""The PMI-1 and PMI-2 commands: what each request a rank sends does to its server.

Why a module of its own: the commands are the long, flat part of the PMI server (one function
per command, two dispatch tables), while pmi.py keeps the state machine they act on: the ranks,
framing, the KVS and collectives, failure bookkeeping. Each command is a function of the server
(``srv``), the sending rank's state and the request; it uses the server's helpers (``srv._ok``,
``srv._key``, ``srv._enter_collective``...) and raises ``_Refused`` for an error reply. The
classes the handover pickles (pmi.py's ``PmiServer``, ``_Rank``, ``Send``...) stay in pmi.py, so
that a pickle names the same classes before and after this split (handover.FORMAT unchanged);
pmi.py imports this module at its end, once those classes exist.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

from tether.supervisor.pmi import (
    MAX_KVSNAME,
    Output,
    PmiServer,
    Protocol,
    Send,
    _int,
    _Rank,
    _Refused,
    _Request,
    _Wire,
)
from tether.supervisor.pmi_wire import preview

# ---- PMI-1 commands -----------------------------------------------------------------------------


def _v1_init(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    if st.initialized:
        raise _Refused("PMI init was already done on this connection")
    version = req.args.get("pmi_version")
    if version == "1":
        # Answer subversion 1 so that newer clients don't send PMI-1.2 barrier groups.
        st.initialized, st.protocol = True, Protocol.PMI1
        return [srv._send(req, [("pmi_version", "1"), ("pmi_subversion", "1"), ("rc", "0")])]
    if version == "2":
        st.initialized, st.protocol = True, Protocol.PMI2
        reply = srv._send(req, [("pmi_version", "2"), ("pmi_subversion", "0"), ("rc", "0")])
        st.wire = _Wire.FRAMES  # every byte after this line is a PMI-2 frame
        return [reply]
    # rc is mandatory; MPICH prints the versions given here in its "version mismatch" error.
    message = f"unsupported_pmi_version_{version}"
    pairs = [("pmi_version", "1"), ("pmi_subversion", "1"), ("rc", "-1"), ("msg", message)]
    return [srv._send(req, pairs)]

def _v1_get_maxes(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    return [srv._send(req, [
        ("kvsname_max", str(MAX_KVSNAME)),
        ("keylen_max", str(srv.max_key)),
        ("vallen_max", str(srv.max_value)),
    ])]

def _v1_get_appnum(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    return [srv._send(req, [("appnum", str(srv.appnum))])]

def _v1_get_my_kvsname(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    return [srv._send(req, [("kvsname", srv.kvsname)])]

def _v1_get_universe_size(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    return [srv._send(req, [("size", str(srv.universe_size))])]

def _v1_put(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    srv._check_kvsname(req)
    srv._put_kvs(srv._key(req), srv._value(req), staged=False)
    return [srv._send(req, [("rc", "0"), ("msg", "success")])]

def _v1_get(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    srv._check_kvsname(req)
    key = srv._key(req)
    value = srv._kvs.get(key)
    if value is None:
        raise _Refused(f"key {key} not found")
    return [srv._send(req, [("rc", "0"), ("msg", "success"), ("value", value)])]

def _v1_barrier_in(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    return srv._enter_collective(st, srv._send(req, []))

def _v1_finalize(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    return srv._finalize(st, srv._send(req, []))

def _v1_abort(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    return srv._abort(st, req.args.get("exitcode"), req.args.get("message", ""))

def _v1_publish_name(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    srv._publish(srv._key(req, "service"), srv._value(req, "port"))
    return [srv._send(req, [("rc", "0")])]

def _v1_unpublish_name(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    srv._unpublish(srv._key(req, "service"))
    return [srv._send(req, [("rc", "0")])]

def _v1_lookup_name(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    return [srv._send(req, [("rc", "0"), ("port", srv._lookup(srv._key(req, "service")))])]

def _v1_spawn(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    # MPICH sends one mcmd block per command and reads one spawn_result after the last
    # (spawnssofar == totspawns); answering each block would desynchronize its stream.
    total, so_far = _int(req.args.get("totspawns")), _int(req.args.get("spawnssofar"))
    if total is not None and so_far is not None and 0 < so_far < total:
        return []
    raise _Refused("spawn is not supported by this launcher")


# ---- PMI-2 commands -----------------------------------------------------------------------------


def _v2_fullinit(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
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
    return [srv._ok(req, *pairs)]

def _v2_job_getid(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    return [srv._ok(req, ("jobid", srv.jobid))]

def _v2_kvs_put(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    srv._put_kvs(srv._key(req), srv._value(req), staged=True)
    return [srv._ok(req)]

def _v2_kvs_fence(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    return srv._enter_collective(st, srv._ok(req))

def _v2_kvs_get(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    jobid = req.args.get("jobid")
    if jobid and jobid != srv.jobid:
        raise _Refused(f"kvs-get for job {preview(jobid)}: only job {srv.jobid} is here")
    value = srv._kvs.get(srv._key(req))  # srcid is only a hint; the KVS is flat
    return [_found(srv, req, value)]

def _v2_info_getjobattr(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    return [_found(srv, req, srv._kvs.get(srv._key(req)))]

def _v2_info_putnodeattr(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    key, value = srv._key(req), srv._value(req)
    srv._store(srv._node_attrs, key, value, srv._node_attrs.get(key), "node attribute")
    out: list[Output] = [srv._ok(req)]
    # Answer the requests held for this key, in arrival order.
    out += [_found(srv, held, value) for held in srv._node_waits.pop(key, [])]
    return out

def _v2_info_getnodeattr(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    key = srv._key(req)
    wait = req.args.get("wait", "FALSE")
    if wait not in ("TRUE", "FALSE"):
        raise _Refused(f"wait must be TRUE or FALSE, got {preview(wait)}")
    value = srv._node_attrs.get(key)
    if value is not None or wait == "FALSE":
        return [_found(srv, req, value)]
    if st.exited:  # late bytes from a dead rank: nobody would read the answer
        return []
    srv._node_waits.setdefault(key, []).append(req)
    return srv._check_stuck(st.rank)

def _found(srv: PmiServer, req: _Request, value: str | None) -> Send:
    if value is None:
        return srv._ok(req, ("found", "FALSE"))
    return srv._ok(req, ("found", "TRUE"), ("value", value))

def _v2_name_publish(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    srv._publish(srv._key(req, "name"), srv._value(req, "port"))
    return [srv._ok(req)]

def _v2_name_unpublish(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    srv._unpublish(srv._key(req, "name"))
    return [srv._ok(req)]

def _v2_name_lookup(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    return [srv._ok(req, ("port", srv._lookup(srv._key(req, "name"))))]

def _v2_finalize(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    return srv._finalize(st, srv._ok(req))

def _v2_abort(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    # Old clients send isworld= and msg=; the PMI-2 spec (and MPICH >= 4.2) exitcode= and
    # message=.
    message = req.args.get("message", req.args.get("msg", ""))
    return srv._abort(st, req.args.get("exitcode"), message)

def _v2_spawn(srv: PmiServer, st: _Rank, req: _Request) -> list[Output]:
    raise _Refused("spawn is not supported by this launcher")


#: A command's handler: the server, the rank that sent it, the request; what to do.
Handler: TypeAlias = Callable[[PmiServer, _Rank, _Request], list[Output]]

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
