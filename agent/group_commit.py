"""Group commit: nothing the agent says or does leaves before the writes it follows are durable.

Each turn of the loop (one poll's events, the timers, the scheduler; daemon.py ``step``) commits
its writes one by one without an fsync; whatever they lead to outside the agent (replies, spawns,
requests to supervisors, kills) is held (``hold``); at the end of the turn the held actions go to
the sync thread as one batch (``flush``, agent/syncer.py), and come back, in order, once one fsync
has made the turn's commits durable (``synced``). So submits and transitions that arrive together
cost one fsync, none is acknowledged before it is durable, and the loop never waits for the disk.

A module of its own because this ordering is the agent's durability promise: every other part
(effects.py, follow.py, answering.py's replies) only ever calls ``hold``. The functions take the
agent and are bound as its methods (daemon.py ``Agent``).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from tether.agent.config import AgentError
from tether.shared.faults import agent_fault

if TYPE_CHECKING:
    from tether.agent.view import GroupCommitAgent as Agent

log = logging.getLogger("tether.agent")


def hold(agent: Agent, action: Callable[[], None]) -> None:
    """Do ``action`` (a reply, a spawn, a request to a supervisor: anything someone could
    act on) now if every write so far is durable and nothing held is still waiting, else
    once that is so (``flush``, ``synced``), in order."""
    if agent.held or agent.db.dirty or agent.syncer.in_flight:
        agent.held.append(action)
    else:
        action()


def flush(agent: Agent) -> None:
    """End of a turn: the turn's held actions go to the sync thread as one batch, to come
    back (``synced``) once one fsync has made the turn's commits durable (group commit).
    The loop does not wait for it."""
    if not agent.held and not agent.db.dirty:
        return
    sync = agent.db.dirty
    if sync:
        agent.db.mark_synced()
    batch, agent.held = list(agent.held), deque()
    agent.syncer.submit(batch, sync)


def synced(agent: Agent) -> None:
    """The sync thread made batches durable: do their actions, in order. What they do
    may write and hold again (a later batch)."""
    try:
        actions = agent.syncer.service()
    except OSError as exc:  # the kernel may have dropped the pages: crash-only, tell
        # nobody anything; a restarted agent reads what the disk really holds
        agent.sync_failed = True
        raise AgentError(f"cannot make the database durable: {exc}") from None
    agent.run_actions(actions)


def run_actions(agent: Agent, actions: list[Callable[[], None]]) -> None:
    for action in actions:
        try:
            action()
        except Exception:  # one job's bug must not keep the others' replies
            log.exception("internal error in %r", action)


def flush_here(agent: Agent) -> None:
    """Make every write durable and do every held action, on the loop and at once (before
    serving and when stopping), until nothing is left."""
    pending = agent.syncer.close() if agent.syncer.in_flight else []
    agent.db.sync(force=bool(pending))  # they may wait for an fsync the thread never did
    agent.run_actions(pending)
    while True:
        agent.db.sync()
        if not agent.held:
            return
        batch, agent.held = list(agent.held), deque()
        agent.run_actions(batch)


def before_sync(agent: Agent, held: bool) -> None:
    """On the sync thread, before each fsync: the faults ``crash-before-sync[:N]`` and
    ``hold-sync``."""
    if held and agent_fault(agent.cfg.faults, "hold-sync"):
        wait_for_go(agent.layout.state_dir, "sync")
    if held and agent_fault(agent.cfg.faults, "fail-sync"):
        raise OSError(errno.EIO, "injected fsync failure (fault fail-sync)")
    if agent.crash_at_sync and held:
        agent.crash_at_sync -= 1
        if not agent.crash_at_sync:
            log.warning("fault injection: SIGKILL before the sync")
            os.kill(os.getpid(), signal.SIGKILL)


def wait_for_go(state_dir: str, what: str) -> None:
    """Test fault: say ``WHAT.held`` in the state directory and wait for ``WHAT.go`` there."""
    with open(os.path.join(state_dir, f"{what}.held"), "w"):
        pass
    while not os.path.exists(os.path.join(state_dir, f"{what}.go")):
        time.sleep(0.02)
