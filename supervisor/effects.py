"""Carrying out what the step machine decides (machine.py), and what requests ask for (I/O).

``feed(event)`` is the one way into the machine: it steps it, writes the new phase and flags into
the step record (step.py, what replies and the exit record say), and carries out the effects in
order. An effect that learns something (the ``launching`` manifest written or not, the exit
record on disk or not) feeds it back at once, so the machine, not this module, decides what
follows. The machine's timers are kept here by name and feed their event when they fire. A
request's own events (a long poll to park, a /proc scan, an upgrade to check) change no state
of the step and are carried out directly. A mixin of ``service.Supervisor``; its state is
``state.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from tether.shared import protocol
from tether.shared.errors import LaunchError
from tether.shared.step_cgroup import CgroupError
from tether.shared.timers import rfc3339_now
from tether.supervisor import machine
from tether.supervisor import machine_effects as fx
from tether.supervisor import machine_events as ev
from tether.supervisor.claims import OPEN_TIMEOUT
from tether.supervisor.state import SupervisorState, killpg

log = logging.getLogger("tether.supervisor")

#: The longest an acknowledged supervisor stays up for followers still reading.
ACK_LINGER = 5.0


class Effects(SupervisorState):
    """The machine's I/O: ``feed`` an event, carry out the effects."""

    def feed(self, event: ev.Event) -> None:
        carry = _REQUESTS.get(type(event))
        if carry is not None:
            carry(self, event)
            return
        assert not isinstance(event, ev.RequestEvent)
        nxt, effects = machine.step(self.machine, event)
        self.settle(nxt)
        for effect in effects:
            _EFFECTS[type(effect)](self, effect)

    def settle(self, m: machine.Machine) -> None:
        """The machine's decision, written into the step record (its phase moves as step.py's
        NEXT allows: a machine that broke it raises here, and the loop gives up)."""
        self.machine = m
        step = self.step
        if step.phase is not m.phase:
            step.advance(m.phase)
        step.cancelled, step.timed_out = m.cancelled, m.timed_out
        step.terminated_by = m.terminated_by

    # ---- timers ------------------------------------------------------------------------------

    def arm(self, name: str, when: float) -> None:
        """The machine's timer ``name`` at ``when`` (CLOCK_MONOTONIC), replacing any."""
        self.disarm(name)
        self.machine_timers[name] = self.timers.at(when, lambda: self._fired(name))

    def disarm(self, name: str) -> None:
        t = self.machine_timers.pop(name, None)
        if t is not None:
            t.cancel()

    def _fired(self, name: str) -> None:
        self.machine_timers.pop(name, None)
        event = _TIMER_EVENTS[name](self)
        if event is not None:
            self.feed(event)

    def timer_deadlines(self, names: tuple[str, ...]) -> dict[str, float]:
        return {n: t.when for n, t in self.machine_timers.items()
                if n in names and not t.cancelled}

    # ---- effects -------------------------------------------------------------------------------

    def _arm_timer(self, e: fx.ArmTimer) -> None:
        self.arm(e.name, time.monotonic() + e.delay)

    def _cancel_timer(self, e: fx.CancelTimer) -> None:
        self.disarm(e.name)

    def _park_claim(self, e: fx.ParkClaim) -> None:
        self.claims.park(None, e.peer, e.rid, OPEN_TIMEOUT + 5.0, None, lambda p: self.reply(
            p.peer, protocol.error(p.rid, LaunchError("the launch is still opening files"))))

    def _start_opener(self, e: fx.StartOpener) -> None:
        self.start_opener()

    def _kill_opener(self, e: fx.KillOpener) -> None:
        if self.opener is not None:
            self.opener.kill()
            self.drop_opener()

    def _discard_files(self, e: fx.DiscardFiles) -> None:
        self.discard_files()

    def _record_launching(self, e: fx.RecordLaunching) -> None:
        if not self.write_manifest(launching=True):
            self.discard_files()
            self.feed(ev.LaunchNotRecorded(
                reason=f"cannot record the launch in {self.rd.manifest}; not starting"))
            return
        limit = self.spec.get("time_limit")
        if not (isinstance(limit, int | float) and not isinstance(limit, bool) and limit > 0):
            limit = None
        self.feed(ev.LaunchRecorded(time_limit=None if limit is None else float(limit)))

    def _fork(self, e: fx.Fork) -> None:
        self.fork()

    def _reap(self, e: fx.Reap) -> None:
        self.reap()

    def _start_fencing(self, e: fx.StartFencing) -> None:
        self.start_fencing()

    def _answer_claims(self, e: fx.AnswerClaims) -> None:
        self.answer_claims()

    def _fail_claims(self, e: fx.FailClaims) -> None:
        for p in self.claims.take(None):
            self.reply(p.peer, protocol.error(p.rid, LaunchError(e.reason)))

    def _note_abort(self, e: fx.NoteAbort) -> None:
        self.step.abort_reason = e.reason
        self.step.ended_at = rfc3339_now()
        log.warning("aborted before launch: %s", e.reason)

    def _terminate(self, e: fx.Terminate) -> None:
        for pid in self.step.live_pids():
            killpg(pid, signal.SIGTERM)
        if self.cgroup.active:
            # every process of the step hears it (a setsid daemon too); a suspended step is
            # thawed so that it can
            self.cgroup.signal_all(signal.SIGTERM)
            with contextlib.suppress(CgroupError):
                self.cgroup.thaw()
        log.info("%s: sent SIGTERM, SIGKILL in %gs", e.why, e.grace)

    def _kill_tasks(self, e: fx.KillTasks) -> None:
        for task in self.step.tasks:
            if task.pid and not task.done:
                log.warning("task %d (pid %d) %s; sending SIGKILL", task.rank, task.pid, e.why)
                killpg(task.pid, signal.SIGKILL)
        self.kill_cgroup()

    def _fail_step(self, e: fx.FailStep) -> None:
        log.warning("%s", e.why)
        self.step.force_failure(e.why)

    def _finish(self, e: fx.Finish) -> None:
        self.measure_end()

    def _write_record(self, e: fx.WriteRecord) -> None:
        self.record = self.build_record()
        if e.keep:
            self.feed(ev.RecordWritten(ok=self.write_record_file()))

    def _announce(self, e: fx.Announce) -> None:
        self.announce_end()

    def _release_waiters(self, e: fx.ReleaseWaiters) -> None:
        self.release_waiters()

    def _remove_run_dir(self, e: fx.RemoveRunDir) -> None:
        self.remove_rundir = True

    def _exit(self, e: fx.Exit) -> None:
        log.info("the step's supervisor is done: %s", e.why)
        self.running = False

    # ---- a request's own events ------------------------------------------------------------------

    def _wait_for(self, e: ev.WaitFor) -> None:
        self.add_waiter(e.peer, e.rid, e.hold)

    def _follow_output(self, e: ev.FollowOutput) -> None:
        self.add_follower(e.peer, e.rid, e.streams, e.offsets, e.hold)

    def _follow_events(self, e: ev.FollowEvents) -> None:
        self.add_event_waiter(e.peer, e.rid, e.after, e.hold)

    def _stream_answered(self, e: ev.StreamAnswered) -> None:
        self.note_stream(e.peer, e.verb, e.ended)

    def _scan_for(self, e: ev.ScanFor) -> None:
        self.after_scan(e.peer, e.rid, e.compute)

    def _ack_requested(self, e: ev.AckRequested) -> None:
        if self.ack_deadline is None:
            self.ack_deadline = time.monotonic() + ACK_LINGER
        reading = self.streams_active()
        if reading and self.machine.state is machine.State.ENDED:
            log.info("acknowledged; staying up to %gs while followers read to the end",
                     ACK_LINGER)
        self.feed(ev.Acked(reading=reading))

    def _upgrade_requested(self, e: ev.UpgradeRequested) -> None:
        self.upgrade_target = self.request_upgrade()


def _time_limit(sup: Effects) -> ev.Event | None:
    return ev.TimeLimit(owed=sup.suspension_owed(), grace=float(sup.spec.get("kill_grace", 10)),
                        why=f"time limit of {limit_text(float(sup.spec['time_limit']))} reached")


def _ack_check(sup: Effects) -> ev.Event | None:
    late = sup.ack_deadline is not None and time.monotonic() >= sup.ack_deadline
    return ev.AckLingerCheck(reading=sup.streams_active(), late=late)


def _record_due(sup: Effects) -> ev.Event | None:
    if sup.machine.state is not machine.State.ENDED:
        return None  # acknowledged meanwhile: the agent has it, and the directory goes
    return ev.RecordWritten(ok=sup.write_record_file())


def _linger(sup: Effects) -> ev.Event | None:
    linger = float(sup.spec["linger"])
    if sup.machine.state is machine.State.ENDED:
        if sup.machine.durable:
            log.warning("no agent acknowledged the result within %gs; leaving the exit record "
                        "at %s", linger, sup.rd.sentinel)
        else:
            log.warning("no agent acknowledged the result and it is not on disk yet; staying "
                        "another %gs", linger)
    return ev.LingerExpired(linger=linger)


def _ready(sup: Effects) -> ev.Event | None:
    sup.ready_manifest()
    return None


#: what each of the machine's timers feeds when it fires
_TIMER_EVENTS: dict[str, Callable[[Effects], ev.Event | None]] = {
    "claim": lambda sup: ev.ClaimExpired(timeout=float(sup.spec["claim_timeout"])),
    "ready": _ready,
    "kill": lambda sup: ev.KillTimer(),
    "limit": _time_limit,
    "drain": lambda sup: ev.Drained(linger=float(sup.spec["linger"])),
    "linger": _linger,
    "record": _record_due,
    "ack": _ack_check,
}
assert set(_TIMER_EVENTS) == set(fx.TIMERS)

_EFFECTS: dict[type, Callable[[Effects, Any], None]] = {
    fx.ArmTimer: Effects._arm_timer, fx.CancelTimer: Effects._cancel_timer,
    fx.ParkClaim: Effects._park_claim, fx.StartOpener: Effects._start_opener,
    fx.KillOpener: Effects._kill_opener, fx.DiscardFiles: Effects._discard_files,
    fx.RecordLaunching: Effects._record_launching, fx.Fork: Effects._fork,
    fx.Reap: Effects._reap, fx.StartFencing: Effects._start_fencing,
    fx.AnswerClaims: Effects._answer_claims, fx.FailClaims: Effects._fail_claims,
    fx.NoteAbort: Effects._note_abort, fx.Terminate: Effects._terminate,
    fx.KillTasks: Effects._kill_tasks, fx.FailStep: Effects._fail_step,
    fx.Finish: Effects._finish, fx.WriteRecord: Effects._write_record,
    fx.Announce: Effects._announce, fx.ReleaseWaiters: Effects._release_waiters,
    fx.RemoveRunDir: Effects._remove_run_dir, fx.Exit: Effects._exit,
}

_REQUESTS: dict[type, Callable[[Effects, Any], None]] = {
    ev.WaitFor: Effects._wait_for, ev.FollowOutput: Effects._follow_output,
    ev.FollowEvents: Effects._follow_events, ev.StreamAnswered: Effects._stream_answered,
    ev.ScanFor: Effects._scan_for, ev.AckRequested: Effects._ack_requested,
    ev.UpgradeRequested: Effects._upgrade_requested,
}


def limit_text(seconds: float) -> str:
    """A limit as Slurm prints one, [D-]HH:MM:SS (fractions of a second, from tests, kept)."""
    s = int(seconds)
    text = f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    if s >= 86400:
        text = f"{s // 86400}-{s % 86400 // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return text if seconds == s else f"{seconds:g}s"
