"""The end of a running step: reaping tasks, draining leftovers, writing the exit record.

``reap`` drains ``waitid`` (SIGCHLD coalesces) and kills a dead leader's process group while the
leader is still an unreaped zombie, so the group id cannot have been reused. Once every task is
reaped the step drains: the cgroup is killed until empty, and children re-parented to us (we are
a subreaper) are found by the sweeper (sweeper.py: our children files, or a scan of /proc off
the loop) and killed by pid, which is safe while they are unreaped. The machine (machine.py)
then ends the step: ``measure_end``, the exit record, ``announce_end``, the linger for the agent's
``ack``. A mixin of ``service.Supervisor``; its state is ``state.py``'s.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from tether.shared.timers import rfc3339_now
from tether.supervisor.machine_events import AllReaped, Drained
from tether.supervisor.state import SupervisorState, killpg
from tether.supervisor.step import Phase, signal_name, usage_of
from tether.supervisor.sweeper import read_children, scan_children

log = logging.getLogger("tether.supervisor")

#: How often a step's cgroup is looked at while its killed processes leave it.
DRAIN_POLL = 0.005


class Reaping(SupervisorState):
    """Reaping tasks, draining leftovers and ending the step."""

    def reap(self) -> None:
        by_pid = {t.pid: t for t in self.step.tasks if t.pid and not t.done}
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
            if info is None or info.si_pid == 0:
                break
            pid = info.si_pid
            task = by_pid.pop(pid, None)
            if task is not None:
                # The leader is a zombie, so its pid (= its group id) is still ours to kill.
                killpg(pid, signal.SIGKILL)
            try:
                _, status, rusage = os.wait4(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            self.sweeper.note_reaped(pid)
            self.launcher.reaped(pid, status)
            if task is not None:
                task.record_status(status, rusage)
                self.step.note_exit(task)
                how = (f"killed by {signal_name(task.signal)}" if task.signal is not None
                       else f"exited with code {task.exit_code}")
                log.info("task %d (pid %d) %s", task.rank, pid, how)
                self.emit("task_exited", rank=task.rank, pid=pid, exit_code=task.exit_code,
                          signal=task.signal)
                if self.pmi is not None:
                    self.handle_pmi(self.pmi.rank_exited(task.rank, not task.failed))
                    if task.failed:
                        # MPI semantics: one failed rank ends the step; the rest are killed.
                        self.kill_ranks(f"rank {task.rank} {how}")
        if self.step.phase is Phase.RUNNING and self.step.all_done:
            self.feed(AllReaped())
        if self.step.phase is Phase.DRAINING:
            self.cgroup_drained()  # kills what is left in the cgroup, the sooner the better
            self.sweeper.start()  # answered in swept(), on this loop

    def cgroup_drained(self) -> bool:
        """Is the step's cgroup empty? If not, kill what is in it and look again shortly (a
        killed process that is not our child sends no SIGCHLD)."""
        if not self.cgroup.active or self.cgroup.empty():
            return True
        self.cgroup.kill()
        if self.cgroup.empty():
            return True
        if self.drain_check is None:
            def again() -> None:
                self.drain_check = None
                self.reap()
            self.drain_check = self.timers.at(time.monotonic() + DRAIN_POLL, again)
        return False

    def swept(self) -> None:
        """The scan for leftover children is in: SIGKILL them; the step ends once a scan
        that no reap overtook finds none. Their deaths reap, and reaping scans again."""
        try:
            found = self.sweeper.result()
        except OSError as exc:  # /proc unreadable: the drain timer still ends the step
            log.error("cannot look for leftover processes: %s", exc)
            return
        for f in found:
            if f.dead:
                continue
            try:
                os.kill(f.pid, signal.SIGKILL)  # unreaped, so still our child: safe by pid
                log.info("killed leftover process %d", f.pid)
            except OSError as exc:  # gone meanwhile, or setuid: counted, logged
                log.warning("cannot kill leftover process %d: %s", f.pid, exc)
        self.leftovers = len(found)
        if self.step.phase is not Phase.DRAINING:
            return
        if self.sweeper.again:
            self.sweeper.start()
        elif not found and self.cgroup_drained():
            self.finish()

    def sweep_now(self) -> int:
        """SIGKILL every remaining child (adopted daemons), on the spot; return how many are
        left. Only for a supervisor giving up: nothing reaps meanwhile, nothing waits."""
        me = os.getpid()
        found = read_children(me) if self.sweeper.inline else scan_children(me)
        for f in found:
            if not f.dead:
                try:
                    os.kill(f.pid, signal.SIGKILL)
                    log.info("killed leftover process %d", f.pid)
                except OSError as exc:  # gone meanwhile, or setuid: counted, logged
                    log.warning("cannot kill leftover process %d: %s", f.pid, exc)
        return len(found)

    def finish(self) -> None:
        """No leftover is left: the machine ends the step (``Drained``), if it is draining."""
        self.feed(Drained(linger=float(self.spec["linger"])))

    def measure_end(self) -> None:
        """The step's end in its record: what it used, an OOM kill, when it ended."""
        left = self.leftovers
        if left:
            log.error("%d leftover process(es) survived SIGKILL; ending the step anyway", left)
        if self.drain_check is not None:
            self.drain_check.cancel()
            self.drain_check = None
        # what the step used, while its cgroup's counters are still there (the record's usage)
        self.step.usage = usage_of(self.step.tasks,
                                   self.cgroup.usage() if self.cgroup.active else {})
        if self.cgroup.active:
            if not self.cgroup.empty():
                log.error("processes %s are still in the step's cgroup; ending the step anyway",
                          sorted(self.cgroup.procs()))
            if self.cgroup.oom_kills() and self.cgroup.memory_mb:
                self.step.oom_mb = self.cgroup.memory_mb
                log.warning("the OOM killer took %d process(es) of the step (limit %d MB)",
                            self.cgroup.oom_kills(), self.cgroup.memory_mb)
        self.step.ended_at = rfc3339_now()
        self.note_pmi_unused()  # in the record too

    def announce_end(self) -> None:
        """The record is out (on disk, or served from memory while the disk refuses): the
        cgroup goes, the log says how the step ended, and ``step_ended`` wakes followers."""
        if self.cgroup.active and not self.cgroup.remove():
            log.error("cannot remove the step's cgroup %s", self.cgroup.dirs)
        assert self.record is not None
        # the record itself is in exit.json (and the agent's database): its outcome here
        rec = self.record
        how = (f"killed by {signal_name(rec['signal'])}" if rec["signal"] is not None
               else f"exit code {rec['exit_code']}" if rec["exit_code"] is not None
               else "no exit status")
        log.info("step ended: %s, %s%s", rec["state"], how,
                 f" ({rec['reason']})" if rec["reason"] else "")
        self.emit("step_ended", state=rec["state"], exit_code=rec["exit_code"],
                  signal=rec["signal"], reason=rec["reason"])
