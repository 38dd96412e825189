"""Following a supervisor: the link to it, its requests (hello, claim, wait, terminate, ack)
and what the agent concludes when one fails or the supervisor is gone.

Each reply becomes a lifecycle event (effects.py ``feed``). When a supervisor's pidfd fires the
link is drained first (its last reply and its exit can land in one poll), then the run directory
decides (``fallback.py``) and the verdict is fed as ``Gone``. A request that fails while the
supervisor still holds its run directory's lock is retried (``LinkError``): a live step is never
resolved from its files.

The functions take the agent and are bound as its methods (daemon.py ``Agent``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import zmq

import tether
import tether.shared.records
from tether.agent import fallback, lifecycle, lifecycle_events
from tether.agent.db import StoreFull
from tether.agent.job import Job
from tether.agent.link import Link
from tether.shared import protocol
from tether.shared.errors import RemoteError, TetherError
from tether.shared.faults import agent_fault
from tether.shared.paths import RunDir
from tether.shared.procid import ProcId, proc_stat

if TYPE_CHECKING:
    from tether.agent.view import FollowAgent as Agent

log = logging.getLogger("tether.agent")

HELLO_TIMEOUT = 2.0
CLAIM_TIMEOUT = 10.0
WAIT_HOLD = 60.0
RETRY_UNRESPONSIVE = 5.0
#: a supervisor that answered ``upgrading`` closes its old connections within its linger (1 s)
UPGRADE_PAUSE = 1.5


def open_link(agent: Agent, job: int, attempt: int, path: str) -> Link:
    link = Link(agent.ctx, agent.timers, job, attempt, path)
    agent.links[job] = link
    agent.by_sock[link.sock] = link
    agent.poller.register(link.sock, zmq.POLLIN)

    def reopened(old: Any, new: Any) -> None:
        """The link's DEALER was replaced (after a timeout)."""
        agent.by_sock.pop(old, None)
        with contextlib.suppress(KeyError):
            agent.poller.unregister(old)
        agent.by_sock[new] = link
        agent.poller.register(new, zmq.POLLIN)
    link.on_reopen = reopened
    link.on_sent = agent.poller.touched  # a send may take the signal of a reply with it
    return link


def connect(agent: Agent, m: lifecycle.Machine, *, fresh: bool) -> Link:
    """Effect ``Connect``: a link to the attempt's supervisor (kept if open), then hello."""
    rd = agent.layout.run_dir(m.job, m.attempt)
    link = agent.links.get(m.job)
    if link is None or link.closed or link.attempt != m.attempt:
        if link is not None:
            agent.drop_link(link)
        link = agent.open_link(m.job, m.attempt, rd.agent_sock())
    agent.hello(link, rd, timeout=CLAIM_TIMEOUT if fresh else HELLO_TIMEOUT, fresh=fresh)
    return link


def drop_link(agent: Agent, link: Link) -> None:
    if agent.links.get(link.job) is link:
        del agent.links[link.job]
    agent.by_sock.pop(link.sock, None)
    with contextlib.suppress(KeyError):
        agent.poller.unregister(link.sock)
    if link.pidfd is not None:
        agent.by_pidfd.pop(link.pidfd, None)
        with contextlib.suppress(KeyError):
            agent.poller.unregister(link.pidfd)
    link.close()


def live(agent: Agent, link: Link) -> bool:
    """True while ``link`` still speaks for its job's current attempt."""
    m = agent.machines.get(link.job)
    return agent.links.get(link.job) is link and m is not None and m.attempt == link.attempt


def hello(agent: Agent, link: Link, rd: RunDir, timeout: float, fresh: bool = False) -> None:
    def ok(res: Any) -> None:
        if not agent.live(link):
            return
        why = fallback.check_identity(rd, res, link.peer_pid)
        if why is None and link.peer_uid not in (-1, 0, os.getuid()):
            why = f"it runs as uid {link.peer_uid}, not as the agent or root"
        if why is None and res.get("protocol") not in protocol.SUPPORTED_VERSIONS:
            why = (f"it answered as tether {res.get('version')!r} in protocol "
                   f"{res.get('protocol')!r}; this agent is {tether.__version__} and speaks "
                   f"{sorted(protocol.SUPPORTED_VERSIONS)}")
        if why is not None:
            log.error("job %d: refusing the process serving %s: %s", link.job, link.path,
                      why)
            agent.drop_link(link)
            agent.gone(link.job, link.attempt,
                      note=f"its socket was served by an impostor ({why})")
            return
        link.protocol, link.release = res["protocol"], str(res.get("version", "?"))
        if fresh and link.release != tether.__version__:
            # The installed tether changed under this agent: its new supervisors are of
            # the new release. Driven in the protocol they share; the agent should follow.
            log.warning("job %d: its new supervisor is tether %s, this agent %s: restart "
                        "the agent to finish the upgrade", link.job, link.release,
                        tether.__version__)
        ident = ProcId(res["boot_id"], res["pid"], res["start_ticks"])
        if not link.watch(ident):
            agent.drop_link(link)
            agent.gone(link.job, link.attempt)
            return
        assert link.pidfd is not None
        agent.by_pidfd[link.pidfd] = link
        agent.poller.register(link.pidfd, zmq.POLLIN)
        st = proc_stat(ident.pid)
        session = st.session if st is not None else None
        facts = {"supervisor_pid": ident.pid, "supervisor_ticks": ident.start_ticks,
                 "supervisor_boot": ident.boot_id, "supervisor_session": session}
        phase = res["phase"]
        m = agent.machines[link.job]
        if phase == "ready" and not m.cancel:
            # A claim follows: its "running" write records the identity too (one commit,
            # one fsync, fewer on every launch). Before that write, the manifest leads to
            # the step; after it, the database does too (fallback.kill_leftovers).
            agent.idents[link.job] = facts
        else:
            job = agent.db.get_required(link.job)
            if (job.supervisor_pid, job.supervisor_ticks, job.supervisor_boot,
                    job.supervisor_session) != tuple(facts.values()):
                try:
                    agent.db.update(job.id, **facts)
                except StoreFull as exc:
                    agent.feed(link.job, link.attempt,
                               lifecycle_events.LinkError(message=exc.message))
                    return
        if phase == "ready" and not m.cancel and agent_fault(agent.cfg.faults,
                                                             "stall-before-claim"):
            log.warning("job %d: fault injection: not claiming", link.job)
            return
        agent.feed(link.job, link.attempt, lifecycle_events.HelloAnswered(phase=str(phase)))

    link.protocol = None  # hello goes out in version 1, which every release speaks
    link.request("hello", {"versions": sorted(protocol.SUPPORTED_VERSIONS)}, timeout, ok,
                 lambda exc: agent.trouble(link, exc))


def claim(agent: Agent, link: Link) -> None:
    def ok(res: Any) -> None:
        if agent.live(link):
            pids = tuple(t["pid"] for t in res["tasks"] if t["pid"])
            agent.feed(link.job, link.attempt,
                      lifecycle_events.Claimed(pids=pids, started_at=res.get("started_at")))
    link.request("claim", link.target, CLAIM_TIMEOUT, ok,
                 lambda exc: agent.trouble(link, exc))


def wait(agent: Agent, link: Link) -> None:
    def ok(res: Any) -> None:
        if not agent.live(link):
            return
        if res.get("upgrading"):
            # It is re-executing (tether upgrade-supervisors): a request sent into the
            # closing connection would be lost, so ask again once the new image serves.
            def again() -> None:
                if agent.live(link):
                    agent.wait(link)
            agent.timers.at(time.monotonic() + UPGRADE_PAUSE, again)
            return
        if not res.get("done"):
            agent.feed(link.job, link.attempt, lifecycle_events.WaitTimedOut())
            return
        verdict = fallback.verdict_of(res.get("record"), f"job {link.job}'s exit record")
        agent.feed(link.job, link.attempt, lifecycle_events.ExitRecord(verdict=verdict))

    args = dict(link.target, hold=WAIT_HOLD)
    link.request("wait", args, WAIT_HOLD + 10.0, ok, lambda exc: agent.trouble(link, exc))


def ack(agent: Agent, m: lifecycle.Machine) -> None:
    """Effect ``Ack`` (C3): once the outcome is recorded, let the supervisor clean up."""
    rd = agent.layout.run_dir(m.job, m.attempt)
    if not os.path.isdir(rd.path) or fallback.lock_is_free(rd):
        agent.feed(m.job, m.attempt, lifecycle_events.Gone(
            verdict=lifecycle_events.NeverRan(reason="its supervisor is gone")))
        return
    link = agent.links.get(m.job)
    if link is None or link.closed:
        link = agent.open_link(m.job, m.attempt, rd.agent_sock())

    def done(_: Any) -> None:
        if agent.live(link):
            agent.feed(link.job, link.attempt, lifecycle_events.Acked())

    def failed(exc: TetherError) -> None:
        if not agent.live(link):
            return
        refused = isinstance(exc, RemoteError)
        if refused:
            log.warning("job %d: its supervisor refused the ack: %s", m.job, exc.message)
        else:
            log.warning("job %d: acknowledging its finished supervisor failed (%s); "
                        "trying again in %gs", m.job, exc.message, RETRY_UNRESPONSIVE)
        agent.feed(link.job, link.attempt,
                  lifecycle_events.AckFailed(refused=refused, message=exc.message))
    link.request("ack", link.target, HELLO_TIMEOUT, done, failed)


def terminate(agent: Agent, link: Link, job: Job | None = None) -> None:
    def ok(res: Any) -> None:
        if agent.live(link):
            agent.feed(link.job, link.attempt,
                      lifecycle_events.Terminated(phase=str(res.get("phase"))))

    def err(exc: TetherError) -> None:
        log.warning("job %d: terminate failed: %s", link.job, exc.message)
    args = dict(link.target, grace=agent.cfg.cancel_grace, cancel=True)
    link.request("terminate", args, HELLO_TIMEOUT, ok, err)


def trouble(agent: Agent, link: Link, exc: TetherError) -> None:
    """A request failed: a dead supervisor goes to the fallback, a hung one is retried."""
    if not agent.live(link):
        return
    if isinstance(exc, RemoteError):
        log.error("job %d: supervisor refused: %s", link.job, exc.message)
    rd = agent.layout.run_dir(link.job, link.attempt)
    if fallback.lock_is_free(rd):
        agent.gone(link.job, link.attempt)
        return
    log.warning("job %d: %s; the supervisor holds its lock, so it is alive: keeping "
                "its allocation and asking again in %gs", link.job, exc.message,
                RETRY_UNRESPONSIVE)
    agent.feed(link.job, link.attempt, lifecycle_events.LinkError(message=exc.message))


def on_supervisor_exit(agent: Agent, link: Link) -> None:
    if link.ident is not None and link.ident.alive():
        return  # not its exit (defensive: pidfds only become readable when it ends)
    link.readable()  # its last reply and its exit may arrive in the same poll
    if agent.live(link):
        agent.gone(link.job, link.attempt)
    else:
        agent.drop_link(link)


def gone(agent: Agent, job_id: int, attempt: int, note: str | None = None) -> None:
    """The supervisor may be gone: what is on disk decides (see fallback.py)."""
    rd = agent.layout.run_dir(job_id, attempt)
    if not fallback.lock_is_free(rd):
        # Someone still holds the run dir's lock: the supervisor is alive, whatever answered
        # (or failed to) on its socket. Never resolve a live step from its files.
        log.error("job %d: its supervisor still holds %s%s; keeping the job and asking "
                  "again in %gs", job_id, rd.lock, f" ({note})" if note else "",
                  RETRY_UNRESPONSIVE)
        agent.feed(job_id, attempt, lifecycle_events.LinkError(message=note or "lock held"))
        return
    job = agent.db.get_required(job_id)
    verdict: lifecycle_events.Verdict
    try:
        verdict = fallback.resolve(rd, job)
    except Exception as exc:  # crash-only: whatever is on disk, a definite verdict
        log.exception("job %d: reading %s", job_id, rd.path)
        verdict = lifecycle_events.Lost(reason=f"its supervisor is gone and its run directory "
                                        f"could not be read ({type(exc).__name__})")
    if isinstance(verdict, lifecycle_events.NeverRan) and (
            fallback.step_processes(job) or agent.contain.populated(job_id, attempt)):
        # Its files say nothing started, but processes of the step live: it did start.
        verdict = lifecycle_events.Lost(reason=f"{verdict.reason}, but processes of the step "
                                        "were running")
    # No supervisor holds the step any more: nothing of it may run on (a lost step's
    # processes, a setsid daemon), and its cgroup goes.
    agent.contain.clean(job_id, attempt)
    if note and isinstance(verdict, lifecycle_events.Lost):
        verdict = lifecycle_events.Lost(reason=f"{verdict.reason}; {note}", kill=verdict.kill)
    agent.feed(job_id, attempt, lifecycle_events.Gone(verdict=verdict))
