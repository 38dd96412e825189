"""From the agent's claim to running tasks, or to an abort before any started.

A claim starts the opener (the job's user's output files, opened as that user); when the files
are in, the manifest says ``launching`` durably, the cgroup is made and the tasks are forked
(launch.py). Until then the step is ``ready``: an abort, or the claim deadline, still wins and
nothing ever runs. What happens when is machine.py's to decide; this is how (I/O). A mixin of
``service.Supervisor``; its state is ``state.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import time

from tether.shared import faults, protocol
from tether.shared.errors import StateError
from tether.shared.step_cgroup import CgroupError, StepCgroup
from tether.shared.timers import rfc3339_now
from tether.supervisor import handlers, ksm
from tether.supervisor.machine_events import FilesOpened
from tether.supervisor.opener import ForkInstead, LaunchFailed, Opened, new_opener, output_paths
from tether.supervisor.state import SupervisorState, killpg
from tether.supervisor.step import Phase, bounded
from tether.supervisor.sweeper import hold

log = logging.getLogger("tether.supervisor")

#: How long the opener (the job's user's files) may take before the launch fails.
OPEN_TIMEOUT = 5.0


class Claims(SupervisorState):
    """The claim, the opener and the launch; or an abort before anything started."""

    def start_opener(self, *, fork: bool = False) -> None:
        try:
            self.opener = new_opener(self.spec, output_paths(self.spec), fork=fork)
        except (OSError, RuntimeError) as exc:  # fork, or a thread, refused
            self.opened(LaunchFailed(f"cannot start the output opener: {exc}"))
            return
        self.poller.register(self.opener, select.POLLIN)
        self.opener_timer = self.timers.at(time.monotonic() + OPEN_TIMEOUT, self.opener_late)

    def opener_ready(self) -> None:
        assert self.opener is not None
        try:
            got: Opened | LaunchFailed = self.opener.result()
        except LaunchFailed as exc:
            got = exc
        except ForkInstead as exc:  # no working directory of its own for a thread here
            log.info("output opener: %s; forking one instead", exc)
            self.drop_opener()
            self.start_opener(fork=True)
            return
        self.opened(got)

    def opener_late(self) -> None:
        if self.opener is not None:
            self.opener.kill()
            self.opened(LaunchFailed(f"the output files could not be opened as "
                                     f"{self.spec.get('user')} within {OPEN_TIMEOUT:g}s"))

    def drop_opener(self) -> None:
        if self.opener is not None:
            with contextlib.suppress(KeyError):
                self.poller.unregister(self.opener)
            self.opener.close()
            self.opener = None
        if self.opener_timer is not None:
            self.opener_timer.cancel()
            self.opener_timer = None

    def opened(self, got: Opened | LaunchFailed) -> None:
        """What the opener handed back: kept for the launch, which the machine decides."""
        self.drop_opener()
        self.opened_files = got
        self.feed(FilesOpened())

    def discard_files(self) -> None:
        """The files opened for a launch that will not happen: closed."""
        got, self.opened_files = self.opened_files, None
        if isinstance(got, Opened):
            got.close()
            for r in got.readers:
                if r is not None:
                    os.close(r)

    def fork(self) -> None:
        """The launch, the ``launching`` manifest being durable (machine.py): phase running.

        That manifest is written *before* the first fork: if this process dies while forking,
        the agent must find "tasks may be running" (lost, leftovers killed), never "never ran"
        (requeued, and run a second time beside the first).
        """
        got, self.opened_files = self.opened_files, None
        assert got is not None
        self.step.started_at = rfc3339_now()
        self.make_cgroup()
        if "limit" in self.machine_timers:  # counted from the launch (its timer just armed)
            self.step.launched_mono = time.monotonic()
        if faults.supervisor_fault("hold-after-task"):
            self.launcher.after_first = lambda: hold(self.rd.path, "task")
        try:
            self.launcher.launch(self.spec, self.step, got)
        except LaunchFailed as exc:
            log.warning("launch failed: %s", exc)
            for task in self.step.tasks:
                if task.pid and not task.done:
                    killpg(task.pid, signal.SIGKILL)
        except Exception as exc:  # EMFILE, ENOMEM, a bug: never a half-started step
            log.exception("launch failed")
            self.fail_launch(f"launch failed: {exc}")
        self.sync_pmi_registrations()
        for task in self.step.tasks:
            if task.pid:
                self.emit("task_started", rank=task.rank, pid=task.pid)
        if faults.supervisor_fault("die-after-launch"):  # test-only: the window before "running"
            hold(self.rd.path, "launched")  # until the test has seen the tasks run
            os.kill(os.getpid(), signal.SIGKILL)
        self.write_manifest()
        if ksm.ENABLED:
            self.timers.at(time.monotonic() + ksm.DELAY, ksm.mark_now)
        log.info("launched %d task(s): pids %s", self.step.ntasks,
                 [t.pid for t in self.step.tasks])

    def make_cgroup(self) -> None:
        """The step's cgroup, before the first fork; the launcher puts each task in it."""
        if not self.cgroup.active:
            return
        try:
            self.cgroup.create()
        except CgroupError as exc:
            # Never a failed launch for want of containment: tracked as without cgroups.
            log.error("%s; the step runs without one (tracked by process group and session)",
                      exc)
            self.cgroup.remove()
            self.cgroup = StepCgroup({"mode": "none"})
            return
        self.launcher.contain = self.cgroup.joined

    def kill_cgroup(self) -> None:
        if self.cgroup.active:
            self.cgroup.kill()

    def answer_claims(self) -> None:
        for p in self.claims.take(None):
            if self.step.phase is Phase.ABORTED:
                self.reply(p.peer, protocol.error(p.rid, StateError(
                    f"step {self.rd.job}.{self.rd.attempt} was aborted before launch: "
                    f"{self.step.abort_reason}")))
            else:
                self.reply(p.peer, protocol.ok(p.rid, handlers.claim_result(self)))

    def fail_launch(self, reason: str) -> None:
        """The tasks already started are killed, the rest never start, and the first of those
        carries ``reason`` into the exit record (exit code 127, like a failed exec)."""
        if self.pmi is not None:
            self.pmi.step_failing(reason)
        told = False
        for task in self.step.tasks:
            if task.done:
                continue
            if task.pid:
                task.killed_by_step = True
                killpg(task.pid, signal.SIGKILL)
            elif not told:
                task.record_launch_failure(reason)
                self.step.note_exit(task)
                told = True
            else:
                task.done = True
                task.reason = bounded(f"not started: {reason}")
        if not told:  # every task had started: the step fails for this reason all the same
            self.step.force_failure(reason)
