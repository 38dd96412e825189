"""Pure unit tests: the wire protocol, the timer heap and the resource ledger."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from tether.agent.ledger import Allocation, Conflict, Ledger
from tether.agent.ledger import Request as Need
from tether.shared import protocol
from tether.shared.errors import BadRequest, RemoteError, UnknownKind, VersionMismatch
from tether.shared.protocol import (
    MAX_FRAME,
    DecodeError,
    Reply,
    Request,
    arg_int,
    arg_number,
    arg_str,
    arg_str_list,
    check_known,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    negotiate,
    peek_id,
)
from tether.shared.timers import Timers, rfc3339_now


def pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj)
    return data


# ---- requests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("req", [
    Request(id=1, kind="status"),
    Request(id=0, kind="status"),
    Request(id=-7, kind="x", args={}),
    Request(id=2**62, kind="submit", args={"command": ["true"], "cpus": 2, "env": {"A": "b"}}),
    Request(id="abc", kind="wait", args={"job": 3, "hold": 1.5}),
    Request(id="x" * 128, kind="show", args={"job": 1}),
    Request(id=5, kind="hello", args={"versions": [1, 2], "nested": {"a": [None, True]}}),
])
def test_request_round_trip(req: Request) -> None:
    assert decode_request(encode_request(req)) == req


def test_request_without_args_defaults_to_empty_map() -> None:
    req = decode_request(pack({"v": 1, "id": 9, "kind": "status"}))
    assert req == Request(id=9, kind="status", args={}, v=1)


@pytest.mark.parametrize("frame, fragment, rid", [
    (b"\xc1", "not valid msgpack", None),                       # never-used msgpack byte
    (b"garbage \xff\x00 bytes", "not valid msgpack", None),      # trailing data
    (b"", "not valid msgpack", None),
    (b"\x92\x01", "not valid msgpack", None),                   # truncated array
    (pack([1, 2, 3]), "must be a map, got list", None),
    (pack("status"), "must be a map, got str", None),
    (pack(42), "must be a map, got int", None),
    (pack(None), "must be a map, got NoneType", None),
    (pack({"v": 1, "kind": "status"}), "no valid 'id'", None),
    (pack({"v": 1, "id": None, "kind": "status"}), "no valid 'id'", None),
    (pack({"v": 1, "id": True, "kind": "status"}), "no valid 'id'", None),
    (pack({"v": 1, "id": 1.5, "kind": "status"}), "no valid 'id'", None),
    (pack({"v": 1, "id": "", "kind": "status"}), "no valid 'id'", None),
    (pack({"v": 1, "id": "x" * 129, "kind": "status"}), "no valid 'id'", None),
    (pack({"v": 1, "id": [1], "kind": "status"}), "no valid 'id'", None),
    (pack({"id": 3, "kind": "status"}), "no integer 'v'", 3),
    (pack({"v": "1", "id": 3, "kind": "status"}), "no integer 'v'", 3),
    (pack({"v": True, "id": 3, "kind": "status"}), "no integer 'v'", 3),
    (pack({"v": 1, "id": 4}), "no 'kind'", 4),
    (pack({"v": 1, "id": 4, "kind": ""}), "no 'kind'", 4),
    (pack({"v": 1, "id": 4, "kind": 7}), "no 'kind'", 4),
    (pack({"v": 1, "id": "r5", "kind": "show", "args": [1]}), "'args' of 'show' must be a map",
     "r5"),
    (pack({"v": 1, "id": 6, "kind": "show", "args": None}), "must be a map", 6),
    (pack({"v": 1, "id": 7, "kind": "show", "args": {}, "extra": 1}), "unknown fields ['extra']",
     7),
    (pack({1: 2}), "not valid msgpack", None),                   # non-string map key (strict)
])
def test_decode_request_errors(frame: bytes, fragment: str, rid: Any) -> None:
    with pytest.raises(DecodeError) as info:
        decode_request(frame)
    assert fragment in info.value.message
    assert info.value.request_id == rid
    assert info.value.code == "bad_request"


@pytest.mark.parametrize("version", [0, 4, -1, 99])
def test_unsupported_version(version: int) -> None:
    with pytest.raises(VersionMismatch) as info:
        decode_request(pack({"v": version, "id": 1, "kind": "status"}))
    assert info.value.code == "version"
    assert str(version) in info.value.message


def test_version_is_checked_before_kind_and_args() -> None:
    with pytest.raises(VersionMismatch):
        decode_request(pack({"v": 99, "id": 1, "args": [], "future_field": 1}))


def test_oversized_frame_is_refused_before_decoding() -> None:
    big = pack({"v": 1, "id": 1, "kind": "x", "args": {"blob": b"\0" * MAX_FRAME}})
    assert len(big) > MAX_FRAME
    with pytest.raises(DecodeError, match="exceeds"):
        decode_request(big)
    with pytest.raises(DecodeError, match="exceeds"):
        decode_reply(b"\x00" * (MAX_FRAME + 1))


def test_frame_of_exactly_max_size_is_not_refused_for_size() -> None:
    head = pack({"v": 1, "id": 1, "kind": "x", "args": {"s": ""}})
    pad = MAX_FRAME - len(head)
    # a str8/16/32 header grows with the length; shrink until the frame is exactly MAX_FRAME
    for n in range(pad, pad - 8, -1):
        frame = pack({"v": 1, "id": 1, "kind": "x", "args": {"s": "a" * n}})
        if len(frame) == MAX_FRAME:
            break
    assert len(frame) == MAX_FRAME
    assert decode_request(frame).kind == "x"


# ---- peek_id ----------------------------------------------------------------------------------


@pytest.mark.parametrize("frame, expected", [
    (pack({"id": 5}), 5),
    (pack({"id": "abc", "v": 99}), "abc"),
    (pack({"v": 1, "id": 8, "kind": "x", "args": "nope"}), 8),
    (pack({1: 2, "id": 11}), 11),                  # non-str keys tolerated here
    (pack({"id": True}), None),
    (pack({"id": ""}), None),
    (pack({"id": 2.0}), None),
    (pack({"kind": "x"}), None),
    (pack([1, 2]), None),
    (b"\xc1\xc1", None),
    (b"", None),
])
def test_peek_id(frame: bytes, expected: Any) -> None:
    assert peek_id(frame) == expected


# ---- replies ----------------------------------------------------------------------------------


@pytest.mark.parametrize("reply", [
    protocol.ok(1, {"done": True, "job": {"id": 1}}),
    protocol.ok("s", None),
    protocol.ok(None, [1, 2]),
    protocol.error(3, BadRequest("nope")),
    protocol.error(None, UnknownKind("what")),
    protocol.error("q", VersionMismatch("v9")),
])
def test_reply_round_trip(reply: Reply) -> None:
    assert decode_reply(encode_reply(reply)) == reply


def test_error_reply_carries_code_and_unwrap_raises() -> None:
    reply = decode_reply(encode_reply(protocol.error(4, UnknownKind("unknown request kind 'x'"))))
    assert (reply.ok, reply.code, reply.message) == (False, "unknown_kind",
                                                      "unknown request kind 'x'")
    with pytest.raises(RemoteError) as info:
        reply.unwrap()
    assert info.value.code == "unknown_kind"
    assert protocol.ok(1, {"a": 1}).unwrap() == {"a": 1}


def test_encoded_reply_has_the_documented_shape() -> None:
    body = msgpack.unpackb(encode_reply(protocol.error(7, BadRequest("bad"))))
    assert body == {"v": 3, "id": 7, "ok": False, "error": {"code": "bad_request",
                                                            "message": "bad"}}
    body = msgpack.unpackb(encode_reply(protocol.ok(7, 3), v=1))  # answered in its request's v
    assert body == {"v": 1, "id": 7, "ok": True, "result": 3}


@pytest.mark.parametrize("frame, fragment", [
    (b"\xc1", "not valid msgpack"),
    (pack([1]), "boolean 'ok'"),
    (pack({"id": 1}), "boolean 'ok'"),
    (pack({"id": 1, "ok": 1}), "boolean 'ok'"),
    (pack({"id": True, "ok": True}), "invalid 'id'"),
    (pack({"id": 1, "ok": False}), "no 'error' map"),
    (pack({"id": 1, "ok": False, "error": "boom"}), "no 'error' map"),
])
def test_decode_reply_errors(frame: bytes, fragment: str) -> None:
    with pytest.raises(DecodeError, match=fragment):
        decode_reply(frame)


# ---- negotiate --------------------------------------------------------------------------------


@pytest.mark.parametrize("offered, expected", [
    ([1], 1),
    ([0, 1, 2, 3], 3),
    ([1, 1], 1),
    ([2, 3], 3),
    ([2, 4], 2),
])
def test_negotiate_common_version(offered: list[int], expected: int) -> None:
    assert negotiate(offered) == expected


@pytest.mark.parametrize("offered", [[], [0], [4, 5], [-1]])
def test_negotiate_nothing_in_common(offered: list[int]) -> None:
    with pytest.raises(VersionMismatch, match="no common protocol version"):
        negotiate(offered)


@pytest.mark.parametrize("offered", [None, 1, "1", (1,), {1: 1}, [1, "2"], [True], [1.0]])
def test_negotiate_bad_input(offered: Any) -> None:
    with pytest.raises(BadRequest, match="list of integers") as info:
        negotiate(offered)
    assert not isinstance(info.value, VersionMismatch)


# ---- argument validators ----------------------------------------------------------------------


@pytest.mark.parametrize("args, kw, expected", [
    ({"n": 3}, {}, 3),
    ({}, {"default": 7}, 7),
    ({"n": 0}, {"minimum": 0}, 0),
    ({"n": 10}, {"maximum": 10}, 10),
    ({"n": -5}, {}, -5),
])
def test_arg_int_ok(args: dict[str, Any], kw: dict[str, Any], expected: int) -> None:
    assert arg_int(args, "n", **kw) == expected


@pytest.mark.parametrize("args, kw, fragment", [
    ({}, {}, "missing argument 'n'"),
    ({"n": None}, {}, "missing argument 'n'"),
    ({"n": "3"}, {}, "must be an integer, got str"),
    ({"n": 3.0}, {}, "must be an integer, got float"),
    ({"n": True}, {}, "must be an integer, got bool"),
    ({"n": 0}, {"minimum": 1}, "at least 1, got 0"),
    ({"n": 11}, {"maximum": 10}, "at most 10, got 11"),
])
def test_arg_int_errors(args: dict[str, Any], kw: dict[str, Any], fragment: str) -> None:
    with pytest.raises(BadRequest, match=fragment):
        arg_int(args, "n", **kw)


@pytest.mark.parametrize("args, expected", [
    ({}, 5.0), ({"x": 0}, 0.0), ({"x": 2}, 2.0), ({"x": 1.5}, 1.5), ({"x": 100}, 100.0),
])
def test_arg_number_ok(args: dict[str, Any], expected: float) -> None:
    value = arg_number(args, "x", default=5.0, maximum=100.0)
    assert value == expected and isinstance(value, float)


@pytest.mark.parametrize("value, fragment", [
    ("1", "must be a number"), (True, "must be a number"), (None, "must be a number"),
    (-0.1, "between"), (100.5, "between"), (float("nan"), "between"),
])
def test_arg_number_errors(value: Any, fragment: str) -> None:
    with pytest.raises(BadRequest, match=fragment):
        arg_number({"x": value}, "x", default=5.0, maximum=100.0)


def test_arg_str() -> None:
    assert arg_str({"s": "hi"}, "s") == "hi"
    assert arg_str({}, "s", default="d") == "d"
    assert arg_str({}, "s", optional=True) is None
    assert arg_str({"s": "x" * 10}, "s", max_len=10) == "x" * 10
    for args, kw, fragment in [
        ({}, {}, "missing argument 's'"),
        ({"s": 3}, {}, "must be a string"),
        ({"s": b"b"}, {}, "must be a string"),
        ({"s": "x" * 11}, {"max_len": 10}, "too long"),
        ({"s": "a\0b"}, {}, "NUL"),
    ]:
        with pytest.raises(BadRequest, match=fragment):
            arg_str(args, "s", **kw)


def test_arg_str_list() -> None:
    assert arg_str_list({"c": ["a", "b"]}, "c") == ["a", "b"]
    assert arg_str_list({"c": []}, "c") == []
    for value in (None, "ab", ("a",), ["a"] * 3):
        with pytest.raises(BadRequest, match="list of at most 2"):
            arg_str_list({"c": value}, "c", max_items=2)
    for value in (["a", 1], ["a\0"], [None]):
        with pytest.raises(BadRequest, match="without NUL"):
            arg_str_list({"c": value}, "c")


def test_check_known() -> None:
    check_known({"a": 1}, "k", ("a", "b"))
    check_known({}, "k", ())
    with pytest.raises(BadRequest, match=r"'k' got unknown arguments \['c', 'd'\]"):
        check_known({"a": 1, "c": 2, "d": 3}, "k", ("a",))


# ---- timers -----------------------------------------------------------------------------------


def test_timers_fire_in_order_and_only_when_due() -> None:
    t = Timers()
    fired: list[str] = []
    t.at(10.0, lambda: fired.append("b"))
    t.at(5.0, lambda: fired.append("a"))
    t.at(10.0, lambda: fired.append("c"))  # same deadline: insertion order
    assert t.timeout_ms(0.0) == 5001
    assert t.timeout_ms(0.0, cap_ms=100) == 100
    t.run_due(4.999)
    assert fired == []
    t.run_due(5.0)
    assert fired == ["a"]
    assert t.timeout_ms(20.0) == 0  # overdue: poll at once (never negative)
    t.run_due(20.0)
    assert fired == ["a", "b", "c"]
    assert t.timeout_ms(20.0) is None
    assert t.timeout_ms(20.0, cap_ms=7) == 7


def test_cancelled_timers_never_fire_and_do_not_shorten_the_timeout() -> None:
    t = Timers()
    fired: list[int] = []
    early = t.at(1.0, lambda: fired.append(1))
    t.at(3.0, lambda: fired.append(3))
    early.cancel()
    assert t.timeout_ms(0.0) == 3001
    t.run_due(5.0)
    assert fired == [3]


def test_timer_callback_may_add_a_timer() -> None:
    t = Timers()
    fired: list[str] = []
    t.at(1.0, lambda: (fired.append("first"), t.at(1.0, lambda: fired.append("second"))))
    t.run_due(1.0)
    assert fired == ["first", "second"]


def test_rfc3339_now_shape() -> None:
    import re
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", rfc3339_now())


# ---- ledger -----------------------------------------------------------------------------------


def test_ledger_allocates_lowest_free_ids() -> None:
    led = Ledger([3, 0, 2, 1], gpus=2, memory_mb=1000)
    a = led.allocate(Need(2, 1, 300))
    assert a == Allocation((0, 1), (0,), 300)
    b = led.allocate(Need(1, 1, 300))
    assert b == Allocation((2,), (1,), 300)
    assert led.usage() == {"beyond_node": {"cpus": [], "gpus": [], "memory_mb": 0},
                           "cpus": {"total": 4, "allocated": 3},
                           "gpus": {"total": 2, "allocated": 2},
                           "memory_mb": {"total": 1000, "allocated": 600}}
    led.release(a)
    assert led.allocate(Need(3, 0, 0)) == Allocation((0, 1, 3), (), 0)
    assert led.allocate(Need(1, 0, 0)) is None


@pytest.mark.parametrize("need, fits_now, never", [
    (Need(2, 0, 0), True, None),
    (Need(3, 0, 0), False, None),
    (Need(0, 1, 0), False, None),
    (Need(0, 0, 600), False, None),
    (Need(0, 0, 500), True, None),
    (Need(5, 0, 0), False, "needs 5 CPUs but this node has 4"),
    (Need(1, 3, 0), False, "needs 3 GPUs but this node has 2"),
    (Need(1, 0, 1001), False, "needs 1001 MB of memory but this node has 1000 MB"),
])
def test_ledger_fits_and_never_fits(need: Need, fits_now: bool, never: str | None) -> None:
    led = Ledger([0, 1, 2, 3], gpus=2, memory_mb=1000)
    assert led.allocate(Need(2, 2, 500)) is not None
    assert led.fits(need) is fits_now
    assert led.never_fits(need) == never


@pytest.mark.parametrize("alloc", [
    Allocation((1, 2), (), 0),      # CPU 1 is taken
    Allocation((2, 9), (), 0),      # CPU 9 does not exist
    Allocation((2,), (0,), 0),      # GPU 0 is taken
    Allocation((2,), (5,), 0),      # GPU 5 does not exist
    Allocation((2,), (), 700),      # more memory than is free
])
def test_ledger_restore_conflict_is_all_or_nothing(alloc: Allocation) -> None:
    led = Ledger([0, 1, 2, 3], gpus=2, memory_mb=1000)
    led.restore(Allocation((0, 1), (0,), 400))
    before = led.usage()
    with pytest.raises(Conflict):
        led.restore(alloc)
    assert led.usage() == before
    # nothing of the refused allocation was taken: CPUs 2 and 3, GPU 1, 600 MB are all free
    assert led.allocate(Need(2, 1, 600)) == Allocation((2, 3), (1,), 600)


def test_ledger_restore_takes_exactly_those_ids() -> None:
    led = Ledger([0, 1, 2, 3], gpus=0, memory_mb=0)
    led.restore(Allocation((1, 3), (), 0))
    assert led.allocate(Need(2, 0, 0)) == Allocation((0, 2), (), 0)


def test_ledger_release_is_bounded_by_the_node() -> None:
    led = Ledger([0, 1], gpus=1, memory_mb=100)
    a = led.allocate(Need(1, 1, 60))
    assert a is not None
    led.release(a)
    led.release(a)  # a double release neither invents ids nor memory
    led.release(Allocation((7,), (3,), 500))
    assert led.usage() == {"beyond_node": {"cpus": [], "gpus": [], "memory_mb": 0},
                           "cpus": {"total": 2, "allocated": 0},
                           "gpus": {"total": 1, "allocated": 0},
                           "memory_mb": {"total": 100, "allocated": 0}}


@pytest.mark.parametrize("cpu, expected", [(0, 4), (4, 4), (6, 4), (1, 6), (2, 4), (7, 6)])
def test_ledger_physical_maps_logical_ids_onto_allowed_cpus(cpu: int, expected: int) -> None:
    """Oversubscribed: the allowed CPUs in turn, each taking as many logical ids."""
    led = Ledger(list(range(8)), gpus=0, memory_mb=0, allowed=[6, 4])
    assert led.physical(cpu) == expected
    assert led.oversubscribed


def test_ledger_physical_is_one_to_one_when_not_oversubscribed() -> None:
    """--cpus 2 with CPUs 1 and 2 allowed: id 1 is allowed, id 0 is not; each gets its own
    (mapping only the ids that are not allowed gave both CPU 1)."""
    led = Ledger([0, 1], gpus=0, memory_mb=0, allowed=[1, 2])
    assert [led.physical(c) for c in (0, 1)] == [1, 2]
    assert not led.oversubscribed


def test_ledger_physical_identity_without_restriction() -> None:
    led = Ledger([0, 1, 2], gpus=0, memory_mb=0)
    assert [led.physical(c) for c in range(3)] == [0, 1, 2]


# ---- versions per kind -----------------------------------------------------------------------


def test_every_handled_kind_says_which_version_it_needs() -> None:
    from tether.agent import api
    from tether.supervisor import handlers
    missing = (set(api.HANDLERS) | set(handlers.HANDLERS)) - set(protocol.KIND_SINCE)
    assert missing == set()
    assert all(v in protocol.SUPPORTED_VERSIONS or v < min(protocol.SUPPORTED_VERSIONS)
               for v in protocol.KIND_SINCE.values())


def test_a_request_goes_out_in_the_negotiated_version_or_its_kinds_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(protocol.KIND_SINCE, "newer", 2)
    assert protocol.version_for("status", None) == 1  # every release that has it accepts 1
    assert protocol.version_for("newer", None) == 2
    assert protocol.version_for("status", 2) == 2
    with pytest.raises(VersionMismatch, match="'newer' needs protocol 2; the peer speaks 1"):
        protocol.version_for("newer", 1)


def test_a_server_refuses_a_kind_newer_than_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(protocol.KIND_SINCE, "newer", 2)
    protocol.check_kind_version(Request(id=1, kind="newer", v=2))
    protocol.check_kind_version(Request(id=1, kind="status", v=1))
    with pytest.raises(VersionMismatch, match="'newer' needs protocol 2; the request speaks 1"):
        protocol.check_kind_version(Request(id=1, kind="newer", v=1))
