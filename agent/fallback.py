"""What the run directory says when its supervisor cannot be asked (I/O, read-mostly).

Theory of operation. The supervisor holds ``lock`` for as long as it lives (the kernel drops the
lock the instant it dies, even on SIGKILL), so a lock we can take means no supervisor. Then:

  exit.json valid, launched         -> the true result (it was fsync'd before anyone was told)
  exit.json valid, not launched     -> never ran: back to the queue
  manifest ``launching`` or ``running``, no exit.json -> ``lost``: the supervisor died with
                                       tasks (possibly) running; every process of the step
                                       still matching its identity is killed
  manifest ``ready`` or no manifest -> never ran: back to the queue

A file that cannot be trusted (not a regular file, a symlink, oversized, bad JSON, wrong job)
counts as absent, with the reason logged and carried into the job's ``reason``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
from typing import Any

from tether.agent.job import Job
from tether.agent.lifecycle_events import Lost, NeverRan, Result, Usage, Verdict
from tether.shared import records
from tether.shared.paths import RunDir
from tether.shared.procid import ProcId, all_processes, boot_id, proc_stat

log = logging.getLogger("tether.agent")

#: sweeps of /proc when killing a lost step (each catches what forked during the last)
KILL_PASSES = 5


def lock_is_free(rd: RunDir) -> bool:
    """True when no process holds the run directory's lock (its supervisor is gone)."""
    try:
        fd = os.open(rd.lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError as exc:
        log.error("%s: cannot open the lock: %s; treating the supervisor as gone", rd.lock, exc)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # also releases the lock if we got it
    return True


def step_over(rd: RunDir, job: Job) -> bool:
    """Has the step ended, though the job's row still says running? Its supervisor writes the
    exit record, then removes the step's cgroup, then tells the agent (a ``suspend`` in that
    window found no freezer); and once no task of it is alive, it is ending."""
    if os.path.exists(rd.sentinel):
        return True
    return bool(job.pids) and all((st := proc_stat(pid)) is None or st.dead for pid in job.pids)


def _load(path: str, reader: Any, rd: RunDir) -> tuple[dict[str, Any] | None, str]:
    try:
        rec = reader(path)
    except FileNotFoundError:
        return None, ""
    except records.RecordError as exc:
        log.error("job %d: ignoring %s", rd.job, exc)
        return None, str(exc)
    if (rec.get("job"), rec.get("attempt")) != (rd.job, rd.attempt):
        why = f"{path}: belongs to job {rec.get('job')}.{rec.get('attempt')}"
        log.error("job %d: ignoring %s", rd.job, why)
        return None, why
    return rec, ""


def verdict_of(record: Any, label: str) -> Verdict:
    """What a supervisor's exit record (from ``wait``) says became of the attempt."""
    try:
        rec = records.check_sentinel(label, record)
    except records.RecordError as exc:
        log.error("%s", exc)
        return Lost(reason=f"its supervisor reported an unusable exit record ({exc})")
    return _from_sentinel(rec)


def _from_sentinel(rec: dict[str, Any]) -> Verdict:
    if not rec["launched"]:
        return NeverRan(reason=rec.get("reason") or "aborted before launch")
    return Result(state=rec["state"], exit_code=rec.get("exit_code"), signal=rec.get("signal"),
                  reason=rec.get("reason"), started_at=rec.get("started_at"),
                  ended_at=rec.get("ended_at"), core_dumped=bool(rec.get("core_dumped")),
                  oom=rec.get("oom") is True, pmi_unused=rec.get("pmi_unused") is True,
                  usage=usage_of(rec.get("usage")))


def usage_of(value: Any) -> Usage | None:
    """The exit record's ``usage`` (what the step used), or None: absent (a supervisor before
    it), or not as written (a figure that is no number is left out, never the result)."""
    if not isinstance(value, dict):
        return None

    def number(key: str) -> float | None:
        v = value.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1e15:
            return None
        return float(v)
    kb = number("maxrss_kb")
    task_kb = number("task_maxrss_kb")
    source = value.get("source")
    return Usage(cpu_user=number("cpu_user"), cpu_system=number("cpu_system"),
                 maxrss_kb=None if kb is None else int(kb),
                 task_maxrss_kb=None if task_kb is None else int(task_kb),
                 source=source if source in ("cgroup", "rusage") else None)


def resolve(rd: RunDir, job: Job) -> Verdict:
    """The verdict of a run directory whose lock is free. Reads only; kills nothing."""
    sentinel, bad_sentinel = _load(rd.sentinel, records.read_sentinel, rd)
    if sentinel is not None:
        return _from_sentinel(sentinel)
    manifest, bad_manifest = _load(rd.manifest, records.read_manifest, rd)
    if manifest is not None:
        why = _foreign(manifest, job)
        if why:
            log.error("job %d: ignoring %s: %s", rd.job, rd.manifest, why)
            manifest, bad_manifest = None, f"{rd.manifest}: {why}"
    if manifest is None or manifest["phase"] == "ready":
        if bad_manifest:
            # We cannot tell whether tasks started; "never ran" could run the job twice.
            return Lost(reason=f"its supervisor is gone and its manifest is unusable "
                               f"({bad_manifest})")
        return NeverRan(reason="its supervisor is gone and never launched the tasks")
    pid = job.supervisor_pid or manifest["supervisor"].get("pid")
    reason = (f"supervisor (pid {pid}) died while the job was {manifest['phase']} and left "
              f"no exit record")
    if bad_sentinel:
        reason += f" (unusable exit record: {bad_sentinel})"
    return Lost(reason=reason)


def _foreign(manifest: dict[str, Any], job: Job) -> str | None:
    """Why a manifest's supervisor is not the one the agent recorded, or None."""
    try:
        ident = ProcId.from_dict(manifest["supervisor"])
    except ValueError as exc:
        return str(exc)
    if job.supervisor_ticks is None or job.supervisor_pid is None:
        return None  # never said hello: the manifest is all there is
    if (ident.pid, ident.start_ticks) != (job.supervisor_pid, job.supervisor_ticks):
        return (f"it names supervisor pid {ident.pid} started at tick {ident.start_ticks}, but "
                f"the agent recorded pid {job.supervisor_pid} started at tick "
                f"{job.supervisor_ticks}")
    return None


def step_processes(job: Job | None) -> set[int]:
    """Live processes of a step whose supervisor is gone, found from the database alone.

    Every task starts in the supervisor's session, after the supervisor: a process in the
    recorded session that started no earlier than the supervisor, in the same boot, belongs to
    the step (every task's process group with it). Nothing is found when the session id has
    been handed to a newer process, or when the database lacks the identity (a supervisor that
    never answered hello launched nothing).
    """
    if job is None or job.supervisor_ticks is None or job.supervisor_boot != boot_id():
        return set()
    t0 = job.supervisor_ticks
    session = job.supervisor_session
    if session is not None:
        leader = proc_stat(session)
        if leader is not None and leader.start_ticks > t0:
            session = None  # reused: that session is someone else's now
    if session is None:
        # a process group alone could be a reused pid's (tests/integration/test_pid_reuse.py)
        return set()
    found = set()
    for st in all_processes():
        if not st.dead and st.start_ticks >= t0 and st.session == session:
            found.add(st.pid)  # task leaders' groups included: they are in the session
    found.discard(os.getpid())
    return found


def kill_leftovers(rd: RunDir, job: Job | None) -> int:
    """Effect ``Kill``: SIGKILL what is left of a lost step, through its manifest (if it is
    usable and names the supervisor the agent recorded) and through the database's identity."""
    try:
        manifest, _ = _load(rd.manifest, records.read_manifest, rd)
    except Exception:  # whatever the file holds, the database's identity still leads us
        log.exception("job %d: reading %s", rd.job, rd.manifest)
        manifest = None
    if manifest is not None and job is not None and _foreign(manifest, job) is not None:
        manifest = None
    killed: set[int] = set()
    # A process forking while the first pass reads /proc is missed by it: pass again until a
    # pass finds nothing new (bounded).
    for _ in range(KILL_PASSES):
        victims = step_processes(job)
        if manifest is not None:
            victims |= manifest_processes(manifest)
        victims -= killed | {os.getpid()}
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                log.warning("job %d: killed leftover process %d of a lost step", rd.job, pid)
            except ProcessLookupError:
                pass
            except OSError as exc:  # e.g. a setuid task while the agent is not root
                log.error("cannot kill leftover process %d of a lost step: %s", pid, exc)
        killed |= victims
    return len(killed)


def manifest_processes(manifest: dict[str, Any]) -> set[int]:
    """The live processes a manifest leads to; never by pid alone.

    Task leaders are matched by (boot id, pid, start ticks); the rest of the step by its session
    (every task starts in the supervisor's session) together with a start time no earlier than
    the supervisor's, and only while the session id has not been handed to a newer process.
    """
    try:
        sup = ProcId.from_dict(manifest["supervisor"])
    except ValueError:
        return set()
    if sup.boot_id != boot_id():
        return set()  # another boot: every process of that step is long gone
    victims: set[int] = set()
    for task in manifest.get("tasks", []):
        try:
            ident = ProcId.from_dict(task)
        except ValueError:
            continue
        if ident.alive():
            victims.add(ident.pid)
    session = manifest["session"]
    leader = proc_stat(session)
    session_reused = leader is not None and leader.start_ticks > sup.start_ticks
    if not session_reused:
        for st in all_processes():
            if st.session == session and not st.dead and st.start_ticks >= sup.start_ticks:
                victims.add(st.pid)
    return victims


def check_identity(rd: RunDir, hello: Any, peer_pid: int) -> str | None:
    """Why the process answering on ``rd``'s socket is not its supervisor, or None if it is."""
    if not isinstance(hello, dict) or hello.get("role") != "supervisor":
        return "it did not say it is a supervisor"
    if (hello.get("job"), hello.get("attempt")) != (rd.job, rd.attempt):
        return f"it claims job {hello.get('job')}.{hello.get('attempt')}"
    try:
        ident = ProcId(str(hello["boot_id"]), int(hello["pid"]), int(hello["start_ticks"]))
    except (KeyError, TypeError, ValueError):
        return "its hello carries no identity"
    if peer_pid > 0 and peer_pid != ident.pid:
        return f"it says pid {ident.pid} but the kernel says pid {peer_pid}"
    if not ident.alive():
        return f"no process (boot id, pid {ident.pid}, start ticks {ident.start_ticks}) exists"
    try:
        manifest = records.read_manifest(rd.manifest)
    except FileNotFoundError:
        return None  # a supervisor between lock and manifest: the lock is the proof
    except records.RecordError as exc:
        return f"its manifest is unusable: {exc}"
    try:
        recorded = ProcId.from_dict(manifest["supervisor"])
    except ValueError as exc:
        return f"its manifest is unusable: {exc}"
    if recorded != ident:
        return "its identity differs from the manifest's"
    return None
