"""The upgrade's hand-over state (supervisor/handover.py, handover_state.py): format 3 is plain
data in msgpack, and the previous release's format (a pickle of 0.6.0's objects, written by
0.6.0's own build) is still read, so a supervisor of that release upgrades into this one.

The state here is made without a supervisor (a step, a PMI server part-way through a barrier,
the rest plain values), so each side of the format is checked field by field; the whole
re-exec, with live tasks, is tests/integration/test_upgrade_supervisors.py's.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from typing import Any

from tests.releases import release
from tether.supervisor import handover, handover_state, machine
from tether.supervisor.pmi import PmiServer
from tether.supervisor.step import Phase, Step

#: release 0.6.0, the last to hand over a pickle (format 2)
RELEASE_0_6_0 = "3a6e8f4"

#: rank 0 is in the barrier with a put made; rank 1 has said init and not yet entered it
RANK0 = (b"cmd=init pmi_version=1 pmi_subversion=1\ncmd=put kvsname=kvs_7 key=k0 value=v0\n"
         b"cmd=barrier_in\n")
RANK1 = b"cmd=init pmi_version=1 pmi_subversion=1\ncmd=put kvsname=kvs_7 key=k1 value=v1\n"
THEN = b"cmd=barrier_in\n"

#: builds the same state with whichever tether it runs under (this build, or 0.6.0's)
MAKE = textwrap.dedent("""
    import os
    from types import SimpleNamespace as NS
    from tether.supervisor import handover
    from tether.supervisor.pmi import PmiServer
    from tether.supervisor.step import Phase, Step

    RANK0, RANK1 = {rank0!r}, {rank1!r}

    def make():
        step = Step(job=7, attempt=2, ntasks=2)
        step.advance(Phase.RUNNING)
        step.started_at, step.launched_mono = "2026-12-04T18:00:00Z", 1234.5
        step.cancelled, step.terminated_by = True, "terminated by the agent"
        t0, t1 = step.tasks
        t0.pid, t0.start_ticks, t1.pid, t1.start_ticks = 4001, 11, 4002, 12
        t1.record_status(9, None)  # killed by SIGKILL
        step.note_exit(t1)
        srv = PmiServer(size=2, jobid="7", kvsname="kvs_7")
        srv.feed(0, RANK0)
        srv.feed(1, RANK1)
        return step, srv

    def fake_supervisor(step, srv, timer):
        chan = NS(ours={{0: NS(fileno=lambda: 41), 1: NS(fileno=lambda: 42)}},
                  pending={{1: bytearray(b"cmd=ab")}})
        sup = NS(step=step, pmi=srv, channels=chan, generation=1,
                 events=[{{"seq": 1, "time": "t", "kind": "task_started", "rank": 0}}],
                 record=None, final_sizes=None, task_end_boottime={{1: 99.5}},
                 launcher=NS(readers={{"stdout": 30, "stderr": 31}}), listen_fd=5, door_fd=6)
        for name in ("claim_timer", "kill_timer", "limit_timer"):
            setattr(sup, name, None)
        sup.kill_timer = timer
        sup.machine_timers = {{"kill": timer}}
        return sup
""").format(rank0=RANK0, rank1=RANK1)

OLD = MAKE + textwrap.dedent("""
    import sys
    step, srv = make()
    sup = fake_supervisor(step, srv, NS(when=5000.25, cancelled=False))
    fd = handover.write_state(handover.capture(sup))
    data = b""
    while chunk := os.read(fd, 1 << 20):
        data += chunk
    sys.stdout.buffer.write(data)
""")


def _check(state: dict[str, Any]) -> None:
    """What both formats must hand over, read back as this build's objects."""
    assert state["generation"] == 2 and state["listen_fd"] == 5 and state["door_fd"] == 6
    assert state["timers"] == {"kill": 5000.25}
    assert state["readers"] == {"stdout": 30, "stderr": 31}
    assert state["task_end_boottime"] == {1: 99.5}
    assert state["events"][0]["kind"] == "task_started"
    step = state["step"]
    assert isinstance(step, Step) and step.phase is Phase.RUNNING
    assert (step.job, step.attempt, step.cancelled, step.launched_mono) == (7, 2, True, 1234.5)
    assert [(t.pid, t.done, t.signal) for t in step.tasks] == [(4001, False, None),
                                                               (4002, True, 9)]
    assert step.first_failure is step.tasks[1]
    assert step.outcome()["state"] == "cancelled"
    pmi = state["pmi"]
    assert pmi["ours"] == {0: 41, 1: 42} and bytes(pmi["pending"][1]) == b"cmd=ab"
    srv = pmi["server"]
    assert isinstance(srv, PmiServer) and srv.snapshot()["waiting"] == [0]
    # the server goes on where it was: rank 1 enters the barrier, both are released
    out = srv.feed(1, THEN)
    assert sorted(o.rank for o in out) == [0, 1]  # type: ignore[union-attr]
    assert srv.snapshot()["epoch"] == 1


def test_format_3_is_plain_data_that_crosses_whole() -> None:
    ns: dict[str, Any] = {}
    exec(MAKE, ns)  # noqa: S102 (the same builder the old release runs, here in this build)
    step, srv = ns["make"]()

    class Timer:
        when, cancelled = 5000.25, False

    sup = ns["fake_supervisor"](step, srv, Timer())
    sup.machine = machine.resume(Phase.RUNNING, cancelled=True, timed_out=False,
                                 terminated_by="terminated by the agent", durable=False,
                                 terminating=True)
    state = handover.capture(sup)
    assert state["format"] == 3 and isinstance(state["step"], dict)  # no object in it
    fd = handover.write_state(state)
    try:
        assert os.pread(fd, len(handover.MAGIC), 0) == handover.MAGIC
        got = handover.read_state(os.dup(fd))
    finally:
        os.close(fd)
    _check(got)
    assert got["machine"] == sup.machine


def test_the_previous_release_s_hand_over_is_read() -> None:
    """0.6.0's own build writes its format-2 pickle; this build reads it as its own state."""
    old = os.path.join(release(RELEASE_0_6_0), "python")
    res = subprocess.run([old, "-I", "-c", OLD], capture_output=True, timeout=120, cwd="/")
    assert res.returncode == 0, res.stderr.decode()
    data = res.stdout
    assert data[:1] == b"\x80", "0.6.0 hands over a pickle"
    state = handover.decode(data)
    assert state["format"] == 2 and state["from"] == "0.6.0" and state["machine"] is None
    _check(state)


def test_an_unknown_format_is_refused() -> None:
    import msgpack
    import pytest

    with pytest.raises(handover.HandoverError, match="unknown format 9"):
        handover.decode(handover.MAGIC + msgpack.packb({"format": 9}))


def test_every_step_field_is_handed_over() -> None:
    """A field added to Step or Task must be handed over too (or this test says which)."""
    from dataclasses import fields

    names = {f.name for f in fields(Step)}
    assert set(handover_state.step_to_dict(Step(job=1, attempt=1, ntasks=1))) == names
    srv = PmiServer(size=1, jobid="1", kvsname="k")
    assert set(handover_state.pmi_to_dict(srv)) == set(vars(srv))
