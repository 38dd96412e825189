"""The tether wire protocol: msgpack maps in single ZeroMQ frames. Pure: no sockets, no clocks.

Request:  {"v": 1, "id": <int|str>, "kind": <str>, "args": {<str>: ...}}
Reply:    {"v": 1, "id": <same id>, "ok": true,  "result": ...}
          {"v": 1, "id": <same id or null>, "ok": false, "error": {"code": <str>, "message": <str>}}

Every request is answered by exactly one reply (a long poll such as ``wait`` answers later, but
once). A frame that cannot be decoded is answered with ``id: null`` when no id could be read from
it, so clients must treat such a reply as the answer to whatever they have in flight on that
connection. ``docs/protocol.md`` is the reference; keep it in step with this module.
"""

from __future__ import annotations

from tether.shared.errors import BadRequest, RemoteError, TetherError, UnknownKind, VersionMismatch
from tether.shared.frozen import Frozen

# Annotations only (they are strings here): ``typing`` and ``collections`` cost every client and
# supervisor ~6 ms of start-up. mypy treats any name TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from typing import Any

#: The version this build speaks, and the set it accepts from peers: this one and every one
#: before (version 1 is still what 0.1.0's CLI and supervisors speak), so a build drives and
#: serves the releases before it.
PROTOCOL_VERSION = 3
SUPPORTED_VERSIONS: frozenset[int] = frozenset({1, 2, 3})

#: The protocol version that introduced each request kind (the agent's and the supervisors'):
#: a request of that kind needs at least that version. A client sends each request in the
#: version it negotiated with that server (``hello``), or before any hello in the kind's own
#: version, which every server that has the kind accepts; it never sends a kind the server's
#: version does not have, and a server refuses a kind newer than the request's ``v``.
#: Add every new kind here with the version that introduces it (docs/protocol.md, "Versions").
KIND_SINCE: dict[str, int] = {
    # both servers
    "hello": 1, "wait": 1,
    # the agent (the CLI's)
    "status": 1, "submit": 1, "list": 1, "show": 1, "cancel": 1,
    # a step's supervisor
    "state": 1, "claim": 1, "ack": 1, "abort": 1, "terminate": 1, "pmi": 1, "info": 1,
    "pids": 1, "stats": 1, "output": 1, "events": 1, "signal": 1,
    # protocol 2 (kinds added in release 0.3.0; a 0.2.0 server answers them unknown_kind)
    "upgrade": 2,
    # protocol 3 (release 0.5.0: holds; submit's time_limit, hold, dependency and array, and
    # the index of an array element in show, wait and cancel, are arguments an older agent
    # refuses by name)
    "hold": 3, "release": 3,
    # issue 9, the same release: freeze and thaw a running job (an older agent answers
    # unknown_kind, which is the truth: it cannot)
    "suspend": 3, "resume": 3,
    # issue 28, release 0.6.0: the accounting history (an older agent answers unknown_kind)
    "acct": 3,
}


def version_for(kind: str, negotiated: int | None) -> int:
    """The ``v`` to send ``kind`` in: the negotiated version, or before any hello the oldest
    version that has the kind. Raises ``VersionMismatch`` if the negotiated one lacks it."""
    since = KIND_SINCE.get(kind, PROTOCOL_VERSION)
    if negotiated is None:
        return since
    if since > negotiated:
        raise VersionMismatch(f"{kind!r} needs protocol {since}; the peer speaks {negotiated}")
    return negotiated


def check_kind_version(req: Request) -> None:
    """Server side: refuse a kind the request's own version does not have."""
    since = KIND_SINCE.get(req.kind)
    if since is not None and req.v < since:
        raise VersionMismatch(f"{req.kind!r} needs protocol {since}; the request speaks {req.v}")

#: Largest frame either side accepts. Sockets set ZMQ_MAXMSGSIZE to this, so a larger frame
#: drops the sender's connection inside libzmq before a byte of it is buffered here.
MAX_FRAME = 1 << 20

RequestId = int | str

#: What one frame may make a reader allocate (msgpack otherwise bounds each container only by
#: the frame's length): strings and binaries up to a frame, containers of at most 64 Ki items.
UNPACK_LIMITS: dict[str, int] = {
    "max_str_len": MAX_FRAME, "max_bin_len": MAX_FRAME, "max_array_len": 1 << 16,
    "max_map_len": 1 << 16, "max_ext_len": 0,
}


#: msgpack, imported at first use (``load_codec``): ~4.5 ms with the ``datetime`` and
#: ``collections`` it imports, which the command lines that send no frame (help, a mistake,
#: ``completion``, ``man``) do not pay. A supervisor loads it before it serves.
codec: Any = None


def load_codec() -> Any:
    global codec
    if codec is None:
        import msgpack

        codec = msgpack
    return codec


class Request(Frozen):
    __slots__ = ("id", "kind", "args", "v")
    id: RequestId
    kind: str
    args: Mapping[str, Any]
    v: int

    def __init__(self, *, id: RequestId, kind: str, args: Mapping[str, Any] | None = None,
                 v: int = PROTOCOL_VERSION) -> None:
        self._init(id=id, kind=kind, args={} if args is None else args, v=v)


class Reply(Frozen):
    __slots__ = ("id", "ok", "result", "code", "message")
    id: RequestId | None
    ok: bool
    result: Any
    code: str
    message: str

    def __init__(self, *, id: RequestId | None, ok: bool, result: Any = None, code: str = "",
                 message: str = "") -> None:
        self._init(id=id, ok=ok, result=result, code=code, message=message)

    def unwrap(self) -> Any:
        """The result, or the error re-raised as ``RemoteError``."""
        if not self.ok:
            raise RemoteError(self.code, self.message)
        return self.result


class DecodeError(BadRequest):
    """A frame that is not a valid request; carries the id when one could be read."""

    def __init__(self, message: str, request_id: RequestId | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def _unpack(data: bytes) -> Any:
    if len(data) > MAX_FRAME:
        raise DecodeError(f"frame of {len(data)} bytes exceeds the {MAX_FRAME}-byte limit")
    try:
        return load_codec().unpackb(data, raw=False, strict_map_key=True, **UNPACK_LIMITS)
    except Exception as exc:  # msgpack raises a zoo of types (ValueError, FormatError, ...)
        raise DecodeError(f"frame is not valid msgpack: {type(exc).__name__}") from None


def _valid_id(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and 0 < len(value) <= 128
    )


def encode_request(req: Request) -> bytes:
    data: bytes = load_codec().packb({"v": req.v, "id": req.id, "kind": req.kind,
                                 "args": dict(req.args)})
    return data


def decode_request(data: bytes) -> Request:
    """Parse and validate one request frame, or raise ``DecodeError``/``VersionMismatch``."""
    obj = _unpack(data)
    if not isinstance(obj, dict):
        raise DecodeError(f"request must be a map, got {type(obj).__name__}")
    rid = obj.get("id")
    if not _valid_id(rid):
        raise DecodeError("request has no valid 'id' (an integer or a short string)")
    version = obj.get("v")
    if not isinstance(version, int) or isinstance(version, bool):
        raise DecodeError("request has no integer 'v' (protocol version)", rid)
    if version not in SUPPORTED_VERSIONS:
        raise VersionMismatch(
            f"protocol version {version} is not supported; this side speaks "
            f"{sorted(SUPPORTED_VERSIONS)}"
        )
    kind = obj.get("kind")
    if not isinstance(kind, str) or not kind:
        raise DecodeError("request has no 'kind'", rid)
    args = obj.get("args", {})
    if not isinstance(args, dict):
        raise DecodeError(f"'args' of {kind!r} must be a map", rid)
    unknown = set(obj) - {"v", "id", "kind", "args"}
    if unknown:
        raise DecodeError(f"request has unknown fields {sorted(unknown)}", rid)
    assert rid is not None
    return Request(id=rid, kind=kind, args=args, v=version)


def peek_id(data: bytes) -> RequestId | None:
    """Best-effort id of an invalid frame, so its error reply can still be matched."""
    try:
        obj = load_codec().unpackb(data, raw=False, strict_map_key=False, **UNPACK_LIMITS)
    except Exception:  # any undecodable frame simply has no id
        return None
    if isinstance(obj, dict) and _valid_id(obj.get("id")):
        rid: RequestId = obj["id"]
        return rid
    return None


def ok(request_id: RequestId | None, result: Any = None) -> Reply:
    return Reply(id=request_id, ok=True, result=result)


def error(request_id: RequestId | None, exc: TetherError) -> Reply:
    return Reply(id=request_id, ok=False, code=exc.code, message=exc.message)


def encode_reply(reply: Reply, v: int = PROTOCOL_VERSION) -> bytes:
    """``v`` is the version the request spoke: a reply answers in its request's version."""
    body: dict[str, Any] = {"v": v, "id": reply.id, "ok": reply.ok}
    if reply.ok:
        body["result"] = reply.result
    else:
        body["error"] = {"code": reply.code, "message": reply.message}
    data: bytes = load_codec().packb(body)
    return data


def decode_reply(data: bytes) -> Reply:
    obj = _unpack(data)
    if not isinstance(obj, dict) or not isinstance(obj.get("ok"), bool):
        raise DecodeError("reply must be a map with a boolean 'ok'")
    rid = obj.get("id")
    if rid is not None and not _valid_id(rid):
        raise DecodeError("reply has an invalid 'id'")
    if obj["ok"]:
        return Reply(id=rid, ok=True, result=obj.get("result"))
    err = obj.get("error")
    if not isinstance(err, dict):
        raise DecodeError("error reply has no 'error' map")
    return Reply(id=rid, ok=False, code=str(err.get("code", "")),
                 message=str(err.get("message", "")))


def negotiate(offered: Any) -> int:
    """Pick the highest version both sides speak from a hello's ``versions`` list."""
    if not isinstance(offered, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in offered
    ):
        raise BadRequest("hello needs 'versions', a list of integers")
    common = SUPPORTED_VERSIONS.intersection(offered)
    if not common:
        raise VersionMismatch(
            f"no common protocol version: peer offers {sorted(offered)}, this side speaks "
            f"{sorted(SUPPORTED_VERSIONS)}"
        )
    return max(common)


# --- argument validation shared by every handler -------------------------------------------


#: the largest integer any argument may carry (SQLite's INTEGER is signed 64-bit)
INT64_MAX = (1 << 63) - 1


def arg_int(
    args: Mapping[str, Any],
    name: str,
    *,
    default: int | None = None,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int:
    value = args.get(name, default)
    if value is None:
        raise BadRequest(f"missing argument {name!r}")
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"argument {name!r} must be an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise BadRequest(f"argument {name!r} must be at least {minimum}, got {value}")
    if maximum is None:
        maximum = INT64_MAX  # what SQLite and every peer can hold
    if value > maximum:
        raise BadRequest(f"argument {name!r} must be at most {maximum}, got {value}")
    return value


def arg_number(args: Mapping[str, Any], name: str, *, default: float, minimum: float = 0.0,
               maximum: float = 1e9) -> float:
    value = args.get(name, default)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise BadRequest(f"argument {name!r} must be a number")
    if not minimum <= value <= maximum:
        raise BadRequest(f"argument {name!r} must be between {minimum} and {maximum}")
    return float(value)


def arg_str(args: Mapping[str, Any], name: str, *, default: str | None = None,
            optional: bool = False, max_len: int = 4096) -> str | None:
    value = args.get(name, default)
    if value is None:
        if optional:
            return None
        raise BadRequest(f"missing argument {name!r}")
    if not isinstance(value, str):
        raise BadRequest(f"argument {name!r} must be a string")
    if len(value) > max_len or "\0" in value:
        raise BadRequest(f"argument {name!r} is too long or contains a NUL byte")
    return value


def arg_str_list(args: Mapping[str, Any], name: str, *, max_items: int = 4096) -> list[str]:
    value = args.get(name)
    if not isinstance(value, list) or len(value) > max_items:
        raise BadRequest(f"argument {name!r} must be a list of at most {max_items} strings")
    for item in value:
        if not isinstance(item, str) or "\0" in item:
            raise BadRequest(f"argument {name!r} must hold strings without NUL bytes")
    return list(value)


def check_known(args: Mapping[str, Any], kind: str, allowed: Iterable[str]) -> None:
    unknown = set(args) - set(allowed)
    if unknown:
        raise BadRequest(f"{kind!r} got unknown arguments {sorted(unknown)}")


__all__ = [
    "MAX_FRAME",
    "PROTOCOL_VERSION",
    "KIND_SINCE",
    "SUPPORTED_VERSIONS",
    "DecodeError",
    "Reply",
    "Request",
    "UnknownKind",
    "check_kind_version",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
    "error",
    "negotiate",
    "ok",
    "peek_id",
    "version_for",
]
