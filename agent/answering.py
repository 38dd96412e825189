"""Answering the agent's clients (the CLI, through the door): each request to ``api.py``, every
reply held until what it tells is durable (``hold``), parked ``wait`` requests and what wakes
them (``job_ended``), and the job ids held for submissions still being checked.

Apart from daemon.py, which keeps the start and stop and the loop. The functions take the agent
and are bound as its methods (daemon.py ``Agent``).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from tether.agent import api
from tether.agent.job import Job
from tether.shared import protocol
from tether.shared.door import answer
from tether.shared.door_conn import Conn

if TYPE_CHECKING:
    from tether.agent.view import AnsweringAgent as Agent

log = logging.getLogger("tether.agent")


def on_request(agent: Agent, conn: Conn, req: protocol.Request) -> None:
    answer(lambda: api.dispatch(agent, conn, req), req, conn,
           lambda r: agent.reply(conn, r), log, api.PENDING, agent.door)


def reserve_id(agent: Agent, count: int = 1) -> int:
    """The first of ``count`` consecutive ids the next recorded jobs get, held until
    ``release_id``. A refused submission gives its ids back when no later one was handed
    out, so ids stay dense."""
    job_id = max(agent.db.last_id(), max(agent.reserved, default=0)) + 1
    agent.reserved.update(range(job_id, job_id + count))
    return job_id


def release_id(agent: Agent, job_id: int, count: int = 1) -> None:
    agent.reserved.difference_update(range(job_id, job_id + count))


def on_door_close(agent: Agent, conn: Conn) -> None:
    agent.waiters.drop_peer(conn.key)


def reply(agent: Agent, conn: Conn, reply: protocol.Reply) -> None:
    """Answer a client: only once what the answer tells is durable (``hold``)."""
    def send() -> None:
        if agent.door is not None:
            agent.door.send(conn, reply)
    agent.hold(send)


def add_waiter(agent: Agent, job_id: int, conn: Conn, rid: protocol.RequestId,
               hold: float) -> None:
    agent.waiters.park(job_id, conn, rid, hold, None,
                       lambda p: agent.reply(p.peer, protocol.ok(p.rid, {"done": False})))


def job_ended(agent: Agent, job: Job) -> None:
    agent.purge.soon()  # its user may keep fewer ended jobs than she now has (retention.py)
    if agent.cluster is not None:
        agent.hold(functools.partial(agent.cluster.job_ended, job))
    for p in agent.waiters.take(job.id):
        agent.reply(p.peer, protocol.ok(p.rid, {"done": True, "job": agent.public(job)}))
    if job.array_id is not None and agent.waiters.parked(-job.array_id):
        # ``wait`` of the whole array (parked under minus its id): once every element ended
        elements = agent.db.array_elements(job.array_id)
        if all(e.final for e in elements):
            outcome = agent.public(api.array_outcome(elements))
            for p in agent.waiters.take(-job.array_id):
                agent.reply(p.peer, protocol.ok(p.rid, {"done": True, "job": outcome}))
