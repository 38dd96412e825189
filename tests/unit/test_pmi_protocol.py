"""Pure tests for supervisor.pmi (with pmi_framing, pmi_commands, pmi_kvs) and pmi_wire, its
codec: PMI-1 and PMI-2 as MPICH (and Slurm's libpmi2) speak them.

No sockets: a harness plays N ranks by feeding bytes and reading the Send outputs. Replies are
compared as text; an expected reply ending in ``*`` is a prefix (for error messages).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest

from tether.supervisor.pmi import (
    ENTRY_OVERHEAD,
    Abort,
    Broken,
    Finalized,
    Output,
    PmiServer,
    ProtocolError,
    Send,
)
from tether.supervisor.pmi_wire import (
    ABSURD_LINE_V1,
    MAX_LINE_V1,
    PmiSyntaxError,
    encode_frame,
    encode_line,
    parse_frame,
    parse_line,
)

JOB, KVS = "job7", "kvs_7_0"
INIT1 = "cmd=init pmi_version=1 pmi_subversion=1"
INIT1_OK = "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"
INIT2 = "cmd=init pmi_version=2 pmi_subversion=0"
INIT2_OK = "cmd=response_to_init pmi_version=2 pmi_subversion=0 rc=0"


# ---- harness ------------------------------------------------------------------------------------


def line(text: str) -> bytes:
    return text.encode("latin-1") + b"\n"


def frame(body: str, *, hydra: bool = False) -> bytes:
    """A PMI-2 frame as MPICH's client writes it (length left-justified), or as Hydra does."""
    data = body.encode("latin-1")
    return (b"%6d" if hydra else b"%-6d") % len(data) + data


def text(send: Send) -> str:
    """One reply as text: a PMI-1 line without its newline, or a PMI-2 body."""
    if send.data.startswith(b"cmd="):
        assert send.data.endswith(b"\n") and send.data.count(b"\n") == 1, send.data
        assert len(send.data) <= MAX_LINE_V1
        return send.data[:-1].decode("latin-1")
    length = int(send.data[:6])
    assert len(send.data) == 6 + length, f"frame length lies: {send.data!r}"
    return send.data[6:].decode("latin-1")


def replies(outputs: Sequence[Output], rank: int | None = None) -> list[str]:
    return [text(o) for o in outputs if isinstance(o, Send) and (rank is None or o.rank == rank)]


def events(outputs: Sequence[Output]) -> list[Output]:
    return [o for o in outputs if not isinstance(o, Send)]


def assert_replies(actual: list[str], expected: list[str]) -> None:
    assert len(actual) == len(expected), (actual, expected)
    for got, want in zip(actual, expected, strict=True):
        if want.endswith("*"):
            assert got.startswith(want[:-1]), (got, want)
        else:
            assert got == want


class Ranks:
    """One PmiServer and the ranks that talk to it."""

    def __init__(self, size: int = 2, **kwargs: object) -> None:
        self.pmi = PmiServer(size=size, jobid=JOB, kvsname=KVS, **kwargs)  # type: ignore[arg-type]

    def v1(self, rank: int, *lines: str) -> list[Output]:
        return self.pmi.feed(rank, b"".join(line(t) for t in lines))

    def v2(self, rank: int, *bodies: str) -> list[Output]:
        return self.pmi.feed(rank, b"".join(frame(b) for b in bodies))

    def init1(self, rank: int) -> None:
        assert replies(self.v1(rank, INIT1)) == [INIT1_OK]

    def init2(self, rank: int) -> None:
        assert replies(self.v1(rank, INIT2)) == [INIT2_OK]
        out = self.v2(rank, f"cmd=fullinit;pmijobid={JOB};pmirank={rank};threaded=FALSE;")
        assert replies(out) == [
            f"cmd=fullinit-response;pmi-version=2;pmi-subversion=0;rank={rank};"
            f"size={self.pmi.size};appnum=0;debugged=FALSE;pmiverbose=FALSE;rc=0;"
        ]


# ---- PMI-1, one command at a time ---------------------------------------------------------------

# Each case runs in order on rank 0 of a one-rank step, after init.
V1_CASES: dict[str, list[tuple[str, list[str]]]] = {
    "maxes": [("cmd=get_maxes", ["cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=1024"])],
    "appnum": [("cmd=get_appnum", ["cmd=appnum appnum=0"])],
    "kvsname": [("cmd=get_my_kvsname", [f"cmd=my_kvsname kvsname={KVS}"])],
    "universe": [("cmd=get_universe_size", ["cmd=universe_size size=1"])],
    "process mapping": [
        (f"cmd=get kvsname={KVS} key=PMI_process_mapping",
         ["cmd=get_result rc=0 msg=success value=(vector,(0,1,1))"]),
    ],
    "put then get": [
        (f"cmd=put kvsname={KVS} key=-bcast-1-0 value=2f6465762f73686d",
         ["cmd=put_result rc=0 msg=success"]),
        (f"cmd=get kvsname={KVS} key=-bcast-1-0",
         ["cmd=get_result rc=0 msg=success value=2f6465762f73686d"]),
    ],
    "values may hold '=' (MPICH segments)": [
        ("cmd=put key=k value=segments=2", ["cmd=put_result rc=0 msg=success"]),
        ("cmd=get key=k", ["cmd=get_result rc=0 msg=success value=segments=2"]),
    ],
    "empty value": [
        ("cmd=put key=k value=", ["cmd=put_result rc=0 msg=success"]),
        ("cmd=get key=k", ["cmd=get_result rc=0 msg=success value="]),
    ],
    "write-once keys, identical re-put tolerated": [
        ("cmd=put key=k value=1", ["cmd=put_result rc=0 msg=success"]),
        ("cmd=put key=k value=1", ["cmd=put_result rc=0 msg=success"]),
        ("cmd=put key=k value=2", ["cmd=put_result rc=-1 msg=KVS_key_'k'_was_already_put*"]),
        ("cmd=put key=PMI_process_mapping value=x", ["cmd=put_result rc=-1 msg=*"]),
    ],
    "missing key": [("cmd=get key=nope", ["cmd=get_result rc=-1 msg=key_nope_not_found"])],
    "other kvsname": [
        ("cmd=get kvsname=other key=PMI_process_mapping", ["cmd=get_result rc=-1 msg=kvsname*"]),
        ("cmd=put kvsname=other key=a value=b", ["cmd=put_result rc=-1 msg=kvsname*"]),
    ],
    "missing attributes": [
        ("cmd=put key=a", ["cmd=put_result rc=-1 msg=put_needs_value="]),
        ("cmd=get", ["cmd=get_result rc=-1 msg=get_needs_key="]),
        ("cmd=put key= value=x", ["cmd=put_result rc=-1 msg=put:_key_must_not_be_empty"]),
    ],
    "oversized key": [
        (f"cmd=put key={'k' * 65} value=x", ["cmd=put_result rc=-1 msg=put:_key_of_65_bytes*"]),
        (f"cmd=get key={'k' * 65}", ["cmd=get_result rc=-1 msg=get:_key_of_65_bytes*"]),
    ],
    "barrier of one": [("cmd=barrier_in", ["cmd=barrier_out"])],
    "names": [
        ("cmd=publish_name service=svc port=tag#0$", ["cmd=publish_result rc=0"]),
        ("cmd=lookup_name service=svc", ["cmd=lookup_result rc=0 port=tag#0$"]),
        ("cmd=publish_name service=svc port=other", ["cmd=publish_result rc=-1 msg=*"]),
        ("cmd=unpublish_name service=svc", ["cmd=unpublish_result rc=0"]),
        ("cmd=lookup_name service=svc", ["cmd=lookup_result rc=-1 msg=service_'svc'*"]),
        ("cmd=unpublish_name service=svc", ["cmd=unpublish_result rc=-1 msg=*"]),
    ],
    "spawn is refused, never left hanging": [
        ("cmd=spawn nprocs=1 execname=a.out", ["cmd=spawn_result rc=-1 msg=spawn_is_not*"]),
    ],
    "unknown command": [
        ("cmd=frobnicate x=1", ["cmd=error rc=-1 msg=unknown_PMI-1_command_'frobnicate'"]),
        ("cmd=initack pmiid=0", ["cmd=error rc=-1 msg=unknown_PMI-1_command*"]),
        ("cmd=kvs-put key=a value=b", ["cmd=error rc=-1 msg=*"]),
    ],
    "second init is refused, not fatal": [
        (INIT1, ["cmd=response_to_init rc=-1 msg=PMI_init_was_already_done*"]),
        ("cmd=get_appnum", ["cmd=appnum appnum=0"]),
    ],
    "first key wins, extra spaces are fine": [
        ("cmd=put  key=a  key=b   value=1 ", ["cmd=put_result rc=0 msg=success"]),
        ("cmd=get key=a", ["cmd=get_result rc=0 msg=success value=1"]),
    ],
    "finalize, twice": [
        ("cmd=finalize", ["cmd=finalize_ack"]),
        # finalize_ack carries no rc that MPICH reads, so a refusal must not wear its name
        ("cmd=finalize", ["cmd=error rc=-1 msg=PMI_finalize_was_already_done*"]),
        ("cmd=barrier_in", ["cmd=error rc=-1 msg=barrier/fence_after_finalize"]),
    ],
}


@pytest.mark.parametrize("steps", V1_CASES.values(), ids=V1_CASES.keys())
def test_pmi1_commands(steps: list[tuple[str, list[str]]]) -> None:
    ranks = Ranks(size=1)
    ranks.init1(0)
    for request, expected in steps:
        out = ranks.v1(0, request)
        assert_replies(replies(out, 0), expected)
        assert not [e for e in events(out) if not isinstance(e, Finalized)]


def test_pmi1_init_with_unknown_version_says_what_we_speak() -> None:
    ranks = Ranks(size=1)
    out = ranks.v1(0, "cmd=init pmi_version=3 pmi_subversion=0")
    assert replies(out) == [
        "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=-1 msg=unsupported_pmi_version_3"
    ]
    ranks.init1(0)  # a failed init does not count as the first one


def test_pmi1_newer_subversion_is_answered_with_ours() -> None:
    ranks = Ranks(size=1)
    assert replies(ranks.v1(0, "cmd=init pmi_version=1 pmi_subversion=2")) == [INIT1_OK]


def test_pmi1_finalize_and_abort_events() -> None:
    ranks = Ranks(size=2)
    ranks.init1(0)
    ranks.init1(1)
    out = ranks.v1(0, "cmd=finalize")
    assert out == [Send(rank=0, data=b"cmd=finalize_ack\n"), Finalized(rank=0)]
    out = ranks.v1(1, "cmd=abort exitcode=7")
    assert out == [Abort(rank=1, code=7, message="")]  # no reply: the client waits to be killed
    assert ranks.v1(0, "cmd=abort exitcode=oops message=bye") == [
        Abort(rank=0, code=1, message="bye")
    ]
    assert ranks.pmi.snapshot()["failure"] == "rank 1 called PMI abort with exit code 7: "


def test_pmi1_spawn_block_is_answered_once_after_the_last_block() -> None:
    # MPI_Comm_spawn_multiple with two commands: one mcmd block each, one spawn_result.
    ranks = Ranks(size=1)
    ranks.init1(0)

    def block(n: int) -> bytes:
        return (
            f"mcmd=spawn\nnprocs=1\nexecname=./a b\ntotspawns=2\nspawnssofar={n}\n"
            "argcnt=0\npreput_num=0\ninfo_num=0\nendcmd\n"
        ).encode()

    assert ranks.pmi.feed(0, block(1)) == []
    assert_replies(replies(ranks.pmi.feed(0, block(2))), ["cmd=spawn_result rc=-1 msg=*"])
    assert replies(ranks.v1(0, "cmd=get_appnum")) == ["cmd=appnum appnum=0"]


def test_pmi1_reply_that_cannot_be_a_line_is_refused() -> None:
    # A PMI-2 rank's value may hold a space, or be longer than a PMI-1 line can carry.
    ranks = Ranks(size=2, max_value=2000)
    ranks.init2(0)
    ranks.init1(1)
    ranks.v2(0, "cmd=kvs-put;key=sp;value=a b;", f"cmd=kvs-put;key=long;value={'x' * 1500};")
    ranks.v2(0, "cmd=kvs-fence;")
    ranks.v1(1, "cmd=barrier_in")
    assert_replies(
        replies(ranks.v1(1, "cmd=get key=sp", "cmd=get key=long")),
        ["cmd=get_result rc=-1 msg=the_reply_cannot_be_sent_over_PMI-1*"] * 2,
    )


# ---- PMI-2, one command at a time ---------------------------------------------------------------

V2_CASES: dict[str, list[tuple[str, list[str]]]] = {
    "job id": [("cmd=job-getid;", [f"cmd=job-getid-response;jobid={JOB};rc=0;"])],
    "process mapping": [
        ("cmd=info-getjobattr;key=PMI_process_mapping;",
         ["cmd=info-getjobattr-response;found=TRUE;value=(vector,(0,1,1));rc=0;"]),
        ("cmd=info-getjobattr;key=universeSize;",
         ["cmd=info-getjobattr-response;found=TRUE;value=1;rc=0;"]),
        ("cmd=info-getjobattr;key=PMI_hwloc_xmlfile;",
         ["cmd=info-getjobattr-response;found=FALSE;rc=0;"]),
    ],
    "puts are visible after the fence": [
        ("cmd=kvs-put;key=k;value=v;", ["cmd=kvs-put-response;rc=0;"]),
        (f"cmd=kvs-get;jobid={JOB};srcid=0;key=k;", ["cmd=kvs-get-response;found=FALSE;rc=0;"]),
        ("cmd=kvs-fence;", ["cmd=kvs-fence-response;rc=0;"]),
        (f"cmd=kvs-get;jobid={JOB};srcid=0;key=k;",
         ["cmd=kvs-get-response;found=TRUE;value=v;rc=0;"]),
    ],
    "';' in values is doubled both ways": [
        ("cmd=kvs-put;key=k;value=a;;b;;;", ["cmd=kvs-put-response;rc=0;"]),
        ("cmd=kvs-fence;", ["cmd=kvs-fence-response;rc=0;"]),
        ("cmd=kvs-get;key=k;", ["cmd=kvs-get-response;found=TRUE;value=a;;b;;;rc=0;"]),
    ],
    "values may hold spaces, '=' and newlines": [
        ("cmd=kvs-put;key=k;value=a b=c\nd;", ["cmd=kvs-put-response;rc=0;"]),
        ("cmd=kvs-fence;", ["cmd=kvs-fence-response;rc=0;"]),
        ("cmd=kvs-get;key=k;", ["cmd=kvs-get-response;found=TRUE;value=a b=c\nd;rc=0;"]),
    ],
    "write-once keys": [
        ("cmd=kvs-put;key=k;value=1;", ["cmd=kvs-put-response;rc=0;"]),
        ("cmd=kvs-put;key=k;value=2;", ["cmd=kvs-put-response;rc=-1;errmsg=KVS key 'k'*"]),
    ],
    "thrid is echoed": [
        ("cmd=kvs-get;thrid=0x7f00;key=nope;",
         ["cmd=kvs-get-response;thrid=0x7f00;found=FALSE;rc=0;"]),
        ("cmd=kvs-fence;thrid=0x1;", ["cmd=kvs-fence-response;thrid=0x1;rc=0;"]),
        ("cmd=bogus;thrid=0x2;", ["cmd=bogus-response;thrid=0x2;rc=-1;errmsg=unknown PMI-2*"]),
    ],
    "node attributes": [
        ("cmd=info-getnodeattr;key=shm;wait=FALSE;",
         ["cmd=info-getnodeattr-response;found=FALSE;rc=0;"]),
        ("cmd=info-getnodeattr;key=shm;", ["cmd=info-getnodeattr-response;found=FALSE;rc=0;"]),
        ("cmd=info-putnodeattr;key=shm;value=/dev/shm/x;", ["cmd=info-putnodeattr-response;rc=0;"]),
        ("cmd=info-getnodeattr;key=shm;wait=TRUE;",
         ["cmd=info-getnodeattr-response;found=TRUE;value=/dev/shm/x;rc=0;"]),
        ("cmd=info-getnodeattr;key=shm;wait=maybe;",
         ["cmd=info-getnodeattr-response;rc=-1;errmsg=wait must be TRUE or FALSE*"]),
    ],
    "names": [
        ("cmd=name-publish;name=svc;port=p;infokeycount=0;", ["cmd=name-publish-response;rc=0;"]),
        ("cmd=name-lookup;name=svc;infokeycount=0;", ["cmd=name-lookup-response;port=p;rc=0;"]),
        ("cmd=name-unpublish;name=svc;infokeycount=0;", ["cmd=name-unpublish-response;rc=0;"]),
        ("cmd=name-lookup;name=svc;", ["cmd=name-lookup-response;rc=-1;errmsg=service 'svc'*"]),
    ],
    "refusals": [
        ("cmd=kvs-get;jobid=other;key=k;", ["cmd=kvs-get-response;rc=-1;errmsg=kvs-get for job*"]),
        ("cmd=kvs-put;key=k;", ["cmd=kvs-put-response;rc=-1;errmsg=kvs-put needs value=;"]),
        (f"cmd=kvs-put;key={'k' * 65};value=v;",
         ["cmd=kvs-put-response;rc=-1;errmsg=kvs-put: key of 65 bytes exceeds keylen_max=64;"]),
        (f"cmd=kvs-put;key=k;value={'v' * 1025};",
         ["cmd=kvs-put-response;rc=-1;errmsg=kvs-put: value of 1025 bytes exceeds vallen_max*"]),
        ("cmd=spawn;ncmds=1;subcmd=a.out;maxprocs=1;argc=0;",
         ["cmd=spawn-response;rc=-1;errmsg=spawn is not supported by this launcher;"]),
        ("cmd=job-connect;jobid=x;", ["cmd=job-connect-response;rc=-1;errmsg=unknown*"]),
        ("cmd=fullinit;pmirank=0;", ["cmd=fullinit-response;rc=-1;errmsg=fullinit was already*"]),
    ],
    "finalize, twice": [
        ("cmd=finalize;", ["cmd=finalize-response;rc=0;"]),
        ("cmd=finalize;", ["cmd=finalize-response;rc=-1;errmsg=PMI finalize was already*"]),
    ],
}


@pytest.mark.parametrize("steps", V2_CASES.values(), ids=V2_CASES.keys())
def test_pmi2_commands(steps: list[tuple[str, list[str]]]) -> None:
    ranks = Ranks(size=1)
    ranks.init2(0)
    for request, expected in steps:
        out = ranks.v2(0, request)
        assert_replies(replies(out, 0), expected)
        assert not [e for e in events(out) if not isinstance(e, Finalized)]


@pytest.mark.parametrize("fullinit, expected", [
    ("cmd=fullinit;pmirank=1;", "rank=1;"),
    ("cmd=fullinit;srcid=1;threaded=TRUE;", "rank=1;"),  # Slurm's libpmi2 with PMI_ID set
    ("cmd=fullinit;", "rank=1;"),  # no claim at all: the connection says who it is
    ("cmd=fullinit;pmirank=0;", "rc=-1;errmsg=fullinit says pmirank=0, but this is rank 1*"),
    ("cmd=fullinit;srcid=x;", "rc=-1;errmsg=fullinit says srcid=x*"),
    ("cmd=fullinit;pmijobid=other;pmirank=1;", "rc=-1;errmsg=fullinit says pmijobid=other*"),
])
def test_pmi2_fullinit_checks_who_is_asking(fullinit: str, expected: str) -> None:
    ranks = Ranks(size=2)
    ranks.v1(1, INIT2)
    [reply] = replies(ranks.v2(1, fullinit))
    body = reply.removeprefix("cmd=fullinit-response;")
    if expected.endswith("*"):
        assert body.startswith(expected[:-1]), body
    else:
        assert expected in body and body.endswith("rc=0;"), body


def test_pmi2_fullinit_names_a_spawner_only_when_given() -> None:
    # spawner-jobid's mere presence makes MPI believe it was spawned, so it is off by default.
    ranks = Ranks(size=1, spawner_jobid="parent1", appnum=3)
    ranks.v1(0, INIT2)
    assert replies(ranks.v2(0, "cmd=fullinit;pmirank=0;")) == [
        "cmd=fullinit-response;pmi-version=2;pmi-subversion=0;rank=0;size=1;appnum=3;"
        "spawner-jobid=parent1;debugged=FALSE;pmiverbose=FALSE;rc=0;"
    ]


@pytest.mark.parametrize("request_body, code, message", [
    ("cmd=abort;isworld=TRUE;msg=MPI_Abort: code 3;", 1, "MPI_Abort: code 3"),  # simple2pmi
    ("cmd=abort;exitcode=3;message=it;;s over;", 3, "it;s over"),  # PMI-2 spec, MPICH >= 4.2
    ("cmd=abort;", 1, ""),
])
def test_pmi2_abort(request_body: str, code: int, message: str) -> None:
    ranks = Ranks(size=1)
    ranks.init2(0)
    assert ranks.v2(0, request_body) == [Abort(rank=0, code=code, message=message)]


def test_pmi2_finalize_event() -> None:
    ranks = Ranks(size=1)
    ranks.init2(0)
    out = ranks.v2(0, "cmd=finalize;thrid=9;")
    assert replies(out) == ["cmd=finalize-response;thrid=9;rc=0;"]
    assert events(out) == [Finalized(rank=0)]


def test_pmi2_lengths_left_or_right_justified() -> None:
    ranks = Ranks(size=1)
    ranks.v1(0, INIT2)
    out = ranks.pmi.feed(0, frame("cmd=fullinit;pmirank=0;", hydra=True) + frame("cmd=job-getid;"))
    assert [r.split(";")[0] for r in replies(out)] == [
        "cmd=fullinit-response", "cmd=job-getid-response"
    ]
    # Our replies use Hydra's right-justified %6u.
    assert all(o.data[:6] == b"%6d" % (len(o.data) - 6) for o in out if isinstance(o, Send))


@pytest.mark.parametrize("hydra", [False, True])
def test_pmi2_without_the_version_handshake(hydra: bool) -> None:
    # The first byte is a length prefix: read the rank as PMI-2 from the start.
    ranks = Ranks(size=1)
    out = ranks.pmi.feed(0, frame("cmd=fullinit;pmirank=0;", hydra=hydra))
    assert replies(out)[0].startswith("cmd=fullinit-response;pmi-version=2;")
    assert ranks.pmi.snapshot()["ranks"][0]["protocol"] == "PMI-2"


# ---- the wire codec -----------------------------------------------------------------------------


@pytest.mark.parametrize("raw, cmd, args", [
    ("cmd=put kvsname=k key=a value=b", "put", {"kvsname": "k", "key": "a", "value": "b"}),
    ("cmd=put key=a value=segments=2", "put", {"key": "a", "value": "segments=2"}),
    ("cmd=barrier_in", "barrier_in", {}),
    ("  cmd=get   key=a  ", "get", {"key": "a"}),
    ("cmd=put key=a key=b", "put", {"key": "a"}),
])
def test_parse_line(raw: str, cmd: str, args: dict[str, str]) -> None:
    assert parse_line(raw.encode()) == (cmd, args)


@pytest.mark.parametrize("raw", ["", "   ", "hello", "cmd=", "key=a cmd=put", "cmd=put key",
                                 "cmd=put =x", "mcmd"])
def test_parse_line_rejects(raw: str) -> None:
    with pytest.raises(PmiSyntaxError):
        parse_line(raw.encode())


@pytest.mark.parametrize("body, cmd, args", [
    ("cmd=kvs-put;key=a;value=b;", "kvs-put", {"key": "a", "value": "b"}),
    ("cmd=kvs-put;key=a;value=b", "kvs-put", {"key": "a", "value": "b"}),  # no final ';'
    ("cmd=x;v=a;;b;", "x", {"v": "a;b"}),
    ("cmd=x;v=;;;", "x", {"v": ";"}),
    ("cmd=x;v=;w=1;", "x", {"v": "", "w": "1"}),
    # ';;' is always an escape (greedy, as MPICH parses): an empty value cannot precede ';'
    ("cmd=x;v=;;w=1;", "x", {"v": ";w=1"}),
    ("cmd=x;v=a=b c\n;", "x", {"v": "a=b c\n"}),
    ("cmd=x;a=1;a=2;", "x", {"a": "1"}),
])
def test_parse_frame(body: str, cmd: str, args: dict[str, str]) -> None:
    assert parse_frame(body.encode()) == (cmd, args)


@pytest.mark.parametrize("body", ["", "key=a;", "cmd=;", "cmd=x;junk", "cmd=x;=1;", "cmd=x;a;b=1;",
                                  ";cmd=x;"])
def test_parse_frame_rejects(body: str) -> None:
    with pytest.raises(PmiSyntaxError):
        parse_frame(body.encode())


@pytest.mark.parametrize("value", ["", ";", ";;", "a;", ";a", "a;;;b", "x" * 1000, "\n ="])
def test_frame_escaping_round_trips(value: str) -> None:
    data = encode_frame("kvs-get-response", [("value", value), ("rc", "0")])
    assert int(data[:6]) == len(data) - 6
    assert parse_frame(data[6:]) == ("kvs-get-response", {"value": value, "rc": "0"})


def test_encode_line_refuses_what_mpich_could_not_parse() -> None:
    assert encode_line("maxes", [("a", "1")]) == b"cmd=maxes a=1\n"
    for pairs in ([("v", "a b")], [("v", "a\nb")], [("v", "x" * MAX_LINE_V1)]):
        with pytest.raises(ValueError):
            encode_line("get_result", pairs)


# ---- malformed and oversized input --------------------------------------------------------------


@pytest.mark.parametrize("data", [
    b"hello\n",
    b"\n",
    b"cmd=put key\n",
    b"cmd=\n",
    b"mcmd=spawn\nnprocs\nendcmd\n",
])
def test_malformed_pmi1_is_a_protocol_error(data: bytes) -> None:
    ranks = Ranks(size=2)
    out = ranks.pmi.feed(0, data)
    assert len(out) == 1 and isinstance(out[0], ProtocolError) and out[0].rank == 0
    assert "rank 0 sent bytes that are not PMI" in out[0].message
    # The stream is abandoned: later input is ignored, and the failure is on record.
    assert ranks.v1(0, INIT1) == []
    snap = ranks.pmi.snapshot()
    assert snap["ranks"][0]["stream_failed"] and snap["failure"] == out[0].message


@pytest.mark.parametrize("data", [
    b"abcdefcmd=job-getid;",  # not a length
    b"12 34 cmd=job-getid;",  # a length with a hole in it
    b"     0",
    b"999999",  # longer than any PMI-2 command may be
    frame("key=a;value=b;"),
    frame("cmd=;"),
    frame("cmd=job-getid;junk"),
])
def test_malformed_pmi2_is_a_protocol_error(data: bytes) -> None:
    ranks = Ranks(size=1)
    ranks.v1(0, INIT2)
    out = ranks.pmi.feed(0, data)
    assert [type(o) for o in out] == [ProtocolError]


def test_overlong_pmi1_line_is_refused_and_the_stream_goes_on() -> None:
    ranks = Ranks(size=1)
    ranks.init1(0)
    big = f"cmd=put kvsname={KVS} key=a value={'x' * 2000}"
    out = ranks.v1(0, big, "cmd=get_appnum")
    assert_replies(replies(out), [
        f"cmd=put_result rc=-1 msg=a_{len(big) + 1}-byte_line_exceeds_the_1024-byte_PMI-1_limit",
        "cmd=appnum appnum=0",
    ])
    assert events(out) == []


def test_overlong_barrier_line_is_not_answered_as_a_release() -> None:
    # barrier_out carries no rc, so refusing under its name would let the rank run on alone.
    ranks = Ranks(size=2)
    ranks.init1(0)
    assert_replies(replies(ranks.v1(0, "cmd=barrier_in " + "x" * 2000)), ["cmd=error rc=-1 *"])
    assert ranks.pmi.snapshot()["waiting"] == []


@pytest.mark.parametrize("chunk", [1000, 4096, ABSURD_LINE_V1 + 10])
def test_absurd_pmi1_line_is_a_protocol_error_however_it_arrives(chunk: int) -> None:
    ranks = Ranks(size=1)
    ranks.init1(0)
    data = b"cmd=put key=a value=" + b"x" * ABSURD_LINE_V1
    out: list[Output] = []
    for start in range(0, len(data), chunk):
        out += ranks.pmi.feed(0, data[start : start + chunk])
    assert [type(o) for o in out] == [ProtocolError]
    # Nothing of it was kept while it was being dropped.
    assert ranks.pmi.snapshot()["ranks"][0]["buffered"] == 0


def test_store_budget_refuses_a_runaway_rank() -> None:
    """Each entry costs its bytes and ENTRY_OVERHEAD; past the budget a put is refused in the
    rank's own protocol, and the rank goes on (its earlier puts are still there)."""
    budget = 2 * ENTRY_OVERHEAD + 10
    ranks = Ranks(size=2, max_store_bytes=budget)
    ranks.init1(0)
    ranks.init2(1)
    assert_replies(replies(ranks.v1(0, "cmd=put key=a value=1234", "cmd=put key=b value=12345")), [
        "cmd=put_result rc=0 msg=success",
        f"cmd=put_result rc=-1 msg=KVS_put_refused:_the_step's_PMI_store_is_full_(it_may_hold_"
        f"{budget}_bytes,_each_entry_counted_with_{ENTRY_OVERHEAD}_bytes_of_overhead;_agent_"
        "--pmi-store-mb)",
    ])
    assert_replies(replies(ranks.v2(1, "cmd=kvs-put;key=c;value=1234;",
                                    "cmd=info-putnodeattr;key=d;value=x;")), [
        "cmd=kvs-put-response;rc=0;",
        "cmd=info-putnodeattr-response;rc=-1;errmsg=node attribute put refused: the step's PMI "
        f"store is full (it may hold {budget} bytes*",
    ])
    assert replies(ranks.v1(0, "cmd=get key=a")) == ["cmd=get_result rc=0 msg=success value=1234"]


def test_small_vallen_max_is_advertised_and_enforced() -> None:
    ranks = Ranks(size=1, max_value=8, max_key=4)
    ranks.init1(0)
    assert replies(ranks.v1(0, "cmd=get_maxes")) == [
        "cmd=maxes kvsname_max=256 keylen_max=4 vallen_max=8"
    ]
    assert_replies(replies(ranks.v1(0, "cmd=put key=k value=123456789")), [
        "cmd=put_result rc=-1 msg=put:_value_of_9_bytes_exceeds_vallen_max=8"
    ])


# ---- partial input ------------------------------------------------------------------------------

PMI1_SESSION = b"".join([
    line(INIT1),
    line("cmd=get_maxes"),
    line("cmd=get_appnum"),
    line("cmd=get_my_kvsname"),
    line("cmd=get kvsname=kvs_7_0 key=PMI_process_mapping"),
    line("cmd=barrier_in"),
    line("cmd=put kvsname=kvs_7_0 key=-allgather-shm-1-0 value=" + "ab" * 200),
    line("cmd=put key=" + "y" * 1500),  # over-long: refused, stream goes on
    b"mcmd=spawn\nnprocs=1\nexecname=a.out\ntotspawns=1\nspawnssofar=1\nendcmd\n",
    line("cmd=barrier_in"),
    line("cmd=get kvsname=kvs_7_0 key=-allgather-shm-1-0"),
    line("cmd=finalize"),
])

PMI2_SESSION = line(INIT2) + b"".join([
    frame("cmd=fullinit;pmijobid=job7;pmirank=0;threaded=FALSE;"),
    frame("cmd=info-getjobattr;key=PMI_process_mapping;", hydra=True),
    frame("cmd=kvs-put;key=bc;value=a;;b;"),
    frame("cmd=info-putnodeattr;key=n;value=v;"),
    frame("cmd=kvs-fence;thrid=0x55;"),
    frame("cmd=kvs-get;jobid=job7;srcid=0;key=bc;"),
    frame("cmd=info-getnodeattr;key=n;wait=TRUE;"),
    frame("cmd=finalize;"),
])


@pytest.mark.parametrize("session", [PMI1_SESSION, PMI2_SESSION], ids=["PMI-1", "PMI-2"])
def test_input_split_at_every_byte_boundary(session: bytes) -> None:
    whole = Ranks(size=1).pmi.feed(0, session)
    assert len(replies(whole)) >= 8 and Finalized(rank=0) in whole
    assert not [e for e in events(whole) if not isinstance(e, Finalized)]
    for cut in range(1, len(session)):
        ranks = Ranks(size=1)
        assert ranks.pmi.feed(0, session[:cut]) + ranks.pmi.feed(0, session[cut:]) == whole, cut
    ranks = Ranks(size=1)
    one_by_one = [o for i in range(len(session)) for o in ranks.pmi.feed(0, session[i : i + 1])]
    assert one_by_one == whole


def test_framing_is_decided_by_the_first_byte_only() -> None:
    # An over-long first line is dropped without buffering; the rest of it, arriving later and
    # starting with a digit, is still part of that line, not a PMI-2 length prefix.
    ranks = Ranks(size=1)
    assert ranks.pmi.feed(0, b"cmd=put key=a value=" + b"x" * 1100) == []
    assert_replies(replies(ranks.pmi.feed(0, b"123456\n" + line(INIT1))), [
        "cmd=put_result rc=-1 msg=a_1127-byte_line_exceeds_the_1024-byte_PMI-1_limit",
        INIT1_OK,
    ])


def test_empty_feed_is_nothing() -> None:
    ranks = Ranks(size=2)
    assert ranks.pmi.feed(0, b"") == []
    assert not ranks.pmi.snapshot()["ranks"][0]["connected"]
    assert ranks.pmi.rank_exited(0, True) == []


# ---- many ranks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["PMI-1", "PMI-2", "mixed"])
def test_barrier_releases_everyone_only_when_the_last_enters(protocol: str) -> None:
    size = 5
    ranks = Ranks(size=size)
    pmi2 = [protocol == "PMI-2" or (protocol == "mixed" and r % 2 == 1) for r in range(size)]
    for rank in range(size):
        ranks.init2(rank) if pmi2[rank] else ranks.init1(rank)

    def enter(rank: int) -> list[Output]:
        return ranks.v2(rank, f"cmd=kvs-fence;thrid={rank};") if pmi2[rank] else ranks.v1(
            rank, "cmd=barrier_in"
        )

    for epoch in (1, 2):
        for rank in [3, 0, 4, 1]:  # arrival order does not matter
            assert enter(rank) == []
        assert ranks.pmi.snapshot()["waiting"] == [0, 1, 3, 4]
        out = enter(2)
        assert [o.rank for o in out if isinstance(o, Send)] == list(range(size))
        for rank in range(size):
            expected = f"cmd=kvs-fence-response;thrid={rank};rc=0;" if pmi2[rank] else (
                "cmd=barrier_out"
            )
            assert replies(out, rank) == [expected]
        snap = ranks.pmi.snapshot()
        assert snap["epoch"] == epoch and snap["waiting"] == []


def test_pmi2_puts_become_visible_to_all_at_the_fence() -> None:
    ranks = Ranks(size=3)
    for rank in range(3):
        ranks.init2(rank)
        ranks.v2(rank, f"cmd=kvs-put;key=addr-{rank};value=ucx{rank};")
    get = "cmd=kvs-get;key=addr-2;"
    assert replies(ranks.v2(0, get)) == ["cmd=kvs-get-response;found=FALSE;rc=0;"]
    assert ranks.pmi.snapshot()["staged_puts"] == 3
    for rank in range(3):
        ranks.v2(rank, "cmd=kvs-fence;")
    for rank in range(3):
        assert replies(ranks.v2(rank, get)) == [
            "cmd=kvs-get-response;found=TRUE;value=ucx2;rc=0;"
        ]
    assert ranks.pmi.snapshot()["staged_puts"] == 0


def test_mpich_402_wire_up_transcript() -> None:
    # What two MPICH 4.0.2 ch4:ucx ranks on one node send, in order (observed; docs/pmi.md).
    ranks = Ranks(size=2)
    for rank in range(2):
        out = ranks.v1(rank, INIT1, "cmd=get_maxes", "cmd=get_appnum", "cmd=get_my_kvsname",
                       f"cmd=get kvsname={KVS} key=PMI_process_mapping")
        assert replies(out)[-1] == "cmd=get_result rc=0 msg=success value=(vector,(0,1,2))"

    def barrier() -> None:
        assert ranks.v1(0, "cmd=barrier_in") == []
        assert replies(ranks.v1(1, "cmd=barrier_in")) == ["cmd=barrier_out"] * 2

    barrier()  # debugger barrier
    ranks.v1(0, f"cmd=put kvsname={KVS} key=-bcast-1-0 value=2f6465762f73686d2f6d70696368")
    barrier()
    assert replies(ranks.v1(1, f"cmd=get kvsname={KVS} key=-bcast-1-0")) == [
        "cmd=get_result rc=0 msg=success value=2f6465762f73686d2f6d70696368"
    ]
    for rank in range(2):
        ranks.v1(rank, f"cmd=put kvsname={KVS} key=-allgather-shm-1-{rank} value={'a1' * 215}")
    barrier()
    for rank in range(2):
        out = ranks.v1(rank, *(f"cmd=get kvsname={KVS} key=-allgather-shm-1-{r}" for r in range(2)))
        got = replies(out)
        assert len(got) == 2 and all(
            r.startswith("cmd=get_result rc=0 msg=success value=a1a1") for r in got), got
    barrier()  # UCX finalize hook
    for rank in range(2):
        assert ranks.v1(rank, "cmd=finalize") == [
            Send(rank=rank, data=b"cmd=finalize_ack\n"), Finalized(rank=rank)
        ]
    assert ranks.pmi.rank_exited(0, True) == [] and ranks.pmi.rank_exited(1, True) == []
    assert ranks.pmi.snapshot()["failure"] is None and ranks.pmi.snapshot()["epoch"] == 4


def test_entering_a_barrier_twice_is_a_protocol_error() -> None:
    ranks = Ranks(size=2)
    ranks.init1(0)
    ranks.v1(0, "cmd=barrier_in")
    assert [type(o) for o in ranks.v1(0, "cmd=barrier_in")] == [ProtocolError]


# ---- node attributes that wait ------------------------------------------------------------------


def test_nodeattr_wait_is_released_by_a_later_put() -> None:
    ranks = Ranks(size=3)
    for rank in range(3):
        ranks.init2(rank)
    assert ranks.v2(0, "cmd=info-getnodeattr;thrid=0xa;key=shm;wait=TRUE;") == []
    assert ranks.v2(2, "cmd=info-getnodeattr;key=shm;wait=TRUE;") == []
    assert ranks.pmi.snapshot()["node_waits"] == {"shm": [0, 2]}
    # A held rank keeps being served meanwhile (threaded clients).
    assert replies(ranks.v2(0, "cmd=job-getid;thrid=0xb;")) == [
        f"cmd=job-getid-response;thrid=0xb;jobid={JOB};rc=0;"
    ]
    out = ranks.v2(1, "cmd=info-putnodeattr;key=shm;value=/dev/shm/seg;")
    assert [(o.rank, text(o)) for o in out if isinstance(o, Send)] == [
        (1, "cmd=info-putnodeattr-response;rc=0;"),
        (0, "cmd=info-getnodeattr-response;thrid=0xa;found=TRUE;value=/dev/shm/seg;rc=0;"),
        (2, "cmd=info-getnodeattr-response;found=TRUE;value=/dev/shm/seg;rc=0;"),
    ]
    assert ranks.pmi.snapshot()["node_waits"] == {}


def test_nodeattr_wait_nobody_can_answer_is_broken() -> None:
    ranks = Ranks(size=2)
    ranks.init2(0)
    ranks.init2(1)
    assert ranks.v2(0, "cmd=info-getnodeattr;key=shm;wait=TRUE;") == []
    out = ranks.v2(1, "cmd=finalize;")
    assert [type(o) for o in out] == [Send, Finalized, Broken]
    assert out[2] == Broken(rank=1, message=ranks.pmi.snapshot()["failure"])
    assert "wait for node attribute(s) shm" in out[2].message


def test_nodeattr_waiter_that_dies_is_forgotten() -> None:
    ranks = Ranks(size=2)
    ranks.init2(0)
    ranks.v2(0, "cmd=info-getnodeattr;key=shm;wait=TRUE;")
    ranks.pmi.rank_exited(0, False)
    assert ranks.pmi.snapshot()["node_waits"] == {}


# ---- ranks that end -----------------------------------------------------------------------------


def test_rank_dying_mid_barrier_breaks_it() -> None:
    ranks = Ranks(size=3)
    for rank in range(3):
        ranks.init1(rank)
    ranks.v1(0, "cmd=barrier_in")
    ranks.v1(1, "cmd=barrier_in")
    [broken] = ranks.pmi.rank_exited(2, False)
    assert isinstance(broken, Broken) and broken.rank == 2
    assert "rank 2 failed after connecting to PMI but without PMI finalize" in broken.message
    # Told once: the step is already failing.
    assert ranks.pmi.rank_exited(0, False) == []
    assert ranks.v1(1, "cmd=get_appnum") != []


def test_ranks_the_step_kills_after_a_failure_are_not_blamed() -> None:
    """Rank 1 fails before PMI init; the supervisor tells the server the step is failing and
    kills the others: their deaths must not become the step's cause (they used to: "rank 0
    failed after connecting to PMI ...", the intermittent test_mpi failure)."""
    ranks = Ranks(size=3)
    ranks.init1(0)
    ranks.init1(2)
    assert ranks.pmi.rank_exited(1, False) == []
    ranks.pmi.step_failing("rank 1 exited with code 3")
    assert ranks.pmi.rank_exited(0, False) == []
    assert ranks.pmi.rank_exited(2, False) == []
    assert ranks.pmi.snapshot()["failure"] == "rank 1 exited with code 3"


def test_rank_dying_inside_the_barrier_breaks_it() -> None:
    ranks = Ranks(size=2)
    ranks.init1(0)
    ranks.init1(1)
    ranks.v1(0, "cmd=barrier_in")
    [broken] = ranks.pmi.rank_exited(0, False)
    assert isinstance(broken, Broken) and broken.rank == 0
    # It is out of the barrier: the survivor entering must not "complete" it.
    assert ranks.pmi.snapshot()["waiting"] == []
    assert ranks.v1(1, "cmd=barrier_in") == []


def test_rank_exiting_0_without_finalize_breaks_the_others() -> None:
    ranks = Ranks(size=2)
    ranks.init1(0)
    ranks.init1(1)
    [broken] = ranks.pmi.rank_exited(1, True)
    assert isinstance(broken, Broken) and broken.rank == 1
    assert broken.message.startswith(
        "rank 1 exited with success after connecting to PMI but without PMI finalize, while "
        "ranks [0] still need it for every later barrier/fence"
    )


def test_rank_that_never_connected_and_exits_0_breaks_nothing() -> None:
    ranks = Ranks(size=2)
    assert ranks.pmi.rank_exited(1, True) == []
    assert ranks.pmi.rank_exited(0, True) == []
    assert ranks.pmi.snapshot()["failure"] is None


def test_rank_that_never_connected_breaks_a_later_barrier() -> None:
    ranks = Ranks(size=2)
    ranks.init1(0)
    assert ranks.pmi.rank_exited(1, True) == []  # nobody waits yet
    [broken] = ranks.v1(0, "cmd=barrier_in")
    assert isinstance(broken, Broken) and broken.rank == 1
    assert broken.message.startswith(
        "rank 1 exited with success without ever connecting to PMI, but ranks [0] wait in "
        "barrier/fence #1, which needs all 2 ranks"
    )


def test_rank_that_never_connected_breaks_a_waiting_fence() -> None:
    ranks = Ranks(size=3)
    ranks.init2(0)
    ranks.init2(1)
    ranks.v2(0, "cmd=kvs-fence;")
    [broken] = ranks.pmi.rank_exited(2, True)
    assert broken == Broken(rank=2, message=ranks.pmi.snapshot()["failure"])
    assert "rank 2 exited with success without ever connecting to PMI" in broken.message


def test_finalizing_while_others_wait_in_a_barrier_breaks_it() -> None:
    ranks = Ranks(size=2)
    ranks.init1(0)
    ranks.init1(1)
    ranks.v1(0, "cmd=barrier_in")
    out = ranks.v1(1, "cmd=finalize")
    assert [type(o) for o in out] == [Send, Finalized, Broken]


def test_exits_after_finalize_are_clean() -> None:
    ranks = Ranks(size=2)
    ranks.init1(0)
    ranks.init2(1)
    ranks.v1(0, "cmd=finalize")
    ranks.v2(1, "cmd=finalize;")
    assert ranks.pmi.rank_exited(0, True) == [] and ranks.pmi.rank_exited(1, True) == []
    assert ranks.pmi.rank_exited(1, True) == []  # twice is nothing new


def test_last_rank_exiting_without_finalize_harms_nobody() -> None:
    ranks = Ranks(size=2)
    ranks.init1(0)
    ranks.init1(1)
    ranks.v1(0, "cmd=finalize")
    assert ranks.pmi.rank_exited(0, True) == []
    assert ranks.pmi.rank_exited(1, True) == []  # nobody is left who could wait for it


def test_abort_is_the_story_not_the_exits_that_follow() -> None:
    ranks = Ranks(size=2)
    ranks.init1(0)
    ranks.init1(1)
    assert ranks.v1(0, "cmd=abort exitcode=3") == [Abort(rank=0, code=3, message="")]
    assert ranks.pmi.rank_exited(0, False) == []
    assert ranks.pmi.rank_exited(1, False) == []


def test_bytes_fed_after_the_exit_still_count() -> None:
    # A client that writes abort and exits may be reaped before its bytes are read.
    ranks = Ranks(size=1)
    assert ranks.pmi.rank_exited(0, False) == []
    out = ranks.v1(0, INIT1, "cmd=abort exitcode=9")
    assert events(out) == [Abort(rank=0, code=9, message="")]


def test_late_barrier_bytes_from_a_dead_rank_do_not_complete_the_barrier() -> None:
    ranks = Ranks(size=2)
    ranks.init1(0)
    assert ranks.pmi.rank_exited(1, False) == []  # killed before its bytes were read
    assert replies(ranks.v1(1, INIT1, "cmd=barrier_in")) == [INIT1_OK]
    [broken] = ranks.v1(0, "cmd=barrier_in")
    assert isinstance(broken, Broken) and broken.rank == 1


def test_rank_index_out_of_range_is_the_callers_bug() -> None:
    ranks = Ranks(size=2)
    with pytest.raises(ValueError):
        ranks.pmi.feed(2, b"cmd=init\n")
    with pytest.raises(ValueError):
        ranks.pmi.rank_exited(-1, True)


# ---- construction, snapshot, outputs ------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"size": 0},
    {"jobid": "has space"},
    {"kvsname": ""},
    {"kvsname": "k" * 257},
    {"process_mapping": "(vector, (0,1,2))"},
    {"max_value": 0},
])
def test_constructor_refuses_bad_configuration(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"size": 2, "jobid": JOB, "kvsname": KVS, **kwargs}
    with pytest.raises(ValueError):
        PmiServer(**args)  # type: ignore[arg-type]


def test_default_process_mapping_puts_every_rank_on_one_node() -> None:
    ranks = Ranks(size=4)
    ranks.init2(0)
    assert replies(ranks.v2(0, "cmd=info-getjobattr;key=PMI_process_mapping;")) == [
        "cmd=info-getjobattr-response;found=TRUE;value=(vector,(0,1,4));rc=0;"
    ]


def test_snapshot_shows_protocols_waiters_and_state() -> None:
    ranks = Ranks(size=3)
    ranks.init1(0)
    ranks.init2(1)
    ranks.v1(0, "cmd=put key=a value=b", "cmd=barrier_in")
    ranks.pmi.feed(2, b"cmd=ini")
    snap = ranks.pmi.snapshot()
    assert snap["epoch"] == 0 and snap["waiting"] == [0] and snap["kvs_keys"] == 3
    per_rank = [(r["protocol"], r["connected"], r["initialized"], r["buffered"])
                for r in snap["ranks"]]
    assert per_rank == [("PMI-1", True, True, 0), ("PMI-2", True, True, 0), (None, True, False, 7)]
    assert "waiting=[0]" in repr(ranks.pmi)


def test_outputs_are_frozen_keyword_only_and_checked() -> None:
    send = Send(rank=0, data=b"x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        send.rank = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        Send(0, b"x")  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        Broken(rank=-1, message="x")


# ---- nothing a rank sends makes feed() raise ----------------------------------------------------

_PIECES = [
    line(INIT1), line(INIT2), line("cmd=barrier_in"), line("cmd=put key=a value=b"),
    line("cmd=get key=a"), line("cmd=finalize"), b"mcmd=spawn\n", b"endcmd\n", b"cmd=", b"\n",
    frame("cmd=fullinit;pmirank=0;"), frame("cmd=kvs-fence;"), frame("cmd=kvs-put;key=k;value=;;"),
    frame("cmd=info-getnodeattr;key=n;wait=TRUE;"), frame("cmd=info-putnodeattr;key=n;value=1;"),
    b"  12", b";;", b"=", b" ", b"\xff\x00", b"x" * 1100,
]


@pytest.mark.parametrize("seed", range(40))
def test_random_input_never_raises(seed: int) -> None:
    rng = random.Random(seed)
    ranks = Ranks(size=3)
    for _ in range(200):
        rank = rng.randrange(3)
        if rng.random() < 0.02:
            out = ranks.pmi.rank_exited(rank, rng.random() < 0.5)
        else:
            data = b"".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 4)))
            out = ranks.pmi.feed(rank, data[: rng.randint(1, len(data))])
        for o in out:
            assert not (isinstance(o, ProtocolError) and "internal error" in o.message), o
            if isinstance(o, Send):
                text(o)  # every reply is well framed
    ranks.pmi.snapshot()
