"""What the supervisor writes down: the manifest, the exit record and the step's events.

Only the ``launching`` manifest is made durable (it says tasks may have run). The exit record is
fsync'd and renamed into place before anyone is told the step ended; while that fails (a full
disk) it is served from memory and written again every ``machine.RECORD_RETRY`` seconds.
Events (task started, task exited, step ended) wake the ``events`` followers (follow.py). A
mixin of ``service.Supervisor``; its state is ``state.py``'s.
"""

from __future__ import annotations

import logging
from typing import Any

import tether
from tether.shared import protocol, records
from tether.shared.procid import boottime
from tether.shared.timers import rfc3339_now
from tether.supervisor import handlers_output
from tether.supervisor.state import SupervisorState
from tether.supervisor.step import Phase

log = logging.getLogger("tether.supervisor")


class Recording(SupervisorState):
    """The manifest, the exit record and the event list."""

    def build_record(self) -> dict[str, Any]:
        rec = {
            "schema": records.SCHEMA, "job": self.rd.job, "attempt": self.rd.attempt,
            "tasks": [t.to_dict() for t in self.step.tasks],
            "started_at": self.step.started_at, "ended_at": self.step.ended_at,
        }
        rec.update(self.step.outcome())
        if self.step.usage is not None:  # what the step used (an aborted step used nothing)
            rec["usage"] = self.step.usage
        return rec

    def write_record_file(self) -> bool:
        """Make the exit record durable (fsync, rename); False if that failed (a full disk):
        the machine has it served from memory meanwhile and written again (machine.py)."""
        assert self.record is not None
        try:
            records.atomic_write_json(self.rd.sentinel, self.record)
        except OSError as exc:
            log.error("cannot write the exit record %s: %s", self.rd.sentinel, exc)
            return False
        return True

    def write_manifest(self, *, launching: bool = False) -> bool:
        assert self.ident is not None
        if launching:
            phase = "launching"
        else:
            phase = "ready" if self.step.phase is Phase.READY else "running"
        man = {
            "schema": records.SCHEMA, "job": self.rd.job, "attempt": self.rd.attempt,
            "phase": phase, "protocol": protocol.PROTOCOL_VERSION, "version": tether.__version__,
            "supervisor": self.ident.to_dict(), "session": self.session,
            "tasks": [{"rank": t.rank, "boot_id": self.ident.boot_id, "pid": t.pid,
                       "start_ticks": t.start_ticks} for t in self.step.tasks if t.pid],
            "cpus": self.spec["cpus"], "gpus": self.spec["gpus"],
            "memory_mb": self.spec["memory_mb"], "output": self.spec["output"],
            "error": self.spec["error"], "socket": self.rd.sock,
            "started_at": self.step.started_at,
        }
        try:
            # Only "launching" must survive a power cut: it is what says tasks may have run
            # (lost, never run again). "ready" and no manifest mean the same (never ran), and
            # "running" adds identities that a reboot makes moot: two fsyncs each, saved.
            records.atomic_write_json(self.rd.manifest, man, durable=launching)
        except OSError as exc:
            log.error("cannot write the manifest %s: %s", self.rd.manifest, exc)
            return False
        return True

    def ready_manifest(self) -> None:
        """The ``ready`` manifest of a supervisor not claimed yet (service.py): once a claim
        has started the launch, the ``launching`` one is what goes on disk."""
        if self.step.phase is Phase.READY and self.opener is None:
            self.write_manifest()

    def emit(self, kind: str, **fields: Any) -> None:
        """Append one event; ``on_event`` (the events verb's waiters) is told."""
        event = {"seq": len(self.events) + 1, "time": rfc3339_now(), "kind": kind, **fields}
        self.events.append(event)
        self.on_event(event)

    def on_event(self, event: dict[str, Any]) -> None:
        """Wake the ``events`` verb's waiters; at the step's end, every follower."""
        if event["kind"] == "task_exited":
            self.task_end_boottime[int(event["rank"])] = boottime()
        if event["kind"] == "step_ended":
            self.step_over()
        else:
            self.wake_event_waiters()

    def step_over(self) -> None:
        """The step has ended (or was aborted): fix the output's final sizes, answer everyone
        parked. Idempotent."""
        if self.final_sizes is None:
            try:
                self.final_sizes = handlers_output.stream_sizes(self)
            except OSError as exc:
                log.error("cannot stat the output files: %s", exc)
                self.final_sizes = {}
        self.wake_followers(force=True)
        self.wake_event_waiters(force=True)
