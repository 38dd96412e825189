"""Long polls: ``wait`` (the agent), ``output`` and ``events`` followers, and the ack linger.

An event wakes its waiters at once (``on_event``). Output growth has no kernel wake-up here, so
the files' sizes are checked every ``FOLLOW_POLL`` seconds, and only while some follower is
parked: nobody following, no timer. When the step ends every parked follower is answered. An
``ack`` does not end the process while a follower is still reading (parked, or answered without
``ended`` within ``STREAM_IDLE``): the supervisor stays, at most ``effects.ACK_LINGER``
seconds, so that followers can read to the end (machine.py decides, asking
``streams_active``). A mixin of ``service.Supervisor``; its state is ``state.py``'s.
"""

from __future__ import annotations

import logging
import time

from tether.shared import protocol
from tether.shared.errors import TetherError
from tether.shared.parking import Parked
from tether.supervisor import handlers_output
from tether.supervisor.state import Follow, Peer, SupervisorState

log = logging.getLogger("tether.supervisor")

#: The longest a parked request is held before it is answered without news.
MAX_HOLD = 600.0
#: How often parked output followers' files are checked for growth (only while any is parked).
FOLLOW_POLL = 0.05
#: A follower answered without ``ended`` counts as still reading for this long.
STREAM_IDLE = 2.0


class Followers(SupervisorState):
    """Parked long polls and the linger for followers after an ack."""

    def note_stream(self, peer: Peer, verb: str, ended: bool) -> None:
        """A follower was answered: it is still reading unless it was told ``ended``."""
        key = (peer.key, verb)
        if ended:
            self.streams.pop(key, None)
        else:
            self.streams[key] = time.monotonic()
            if len(self.streams) > 64:
                self.prune_streams()

    def prune_streams(self) -> None:
        """Forget followers that went quiet (detached, or gone without reading to the end)."""
        now = time.monotonic()
        for key, seen in list(self.streams.items()):
            if now - seen > STREAM_IDLE:
                del self.streams[key]

    def streams_active(self) -> bool:
        """Is a follower parked, or was one answered without ``ended`` just now?"""
        self.prune_streams()
        return bool(len(self.followers) or len(self.event_waiters) or self.streams)

    def add_follower(self, peer: Peer, rid: protocol.RequestId, streams: tuple[str, ...],
                     offsets: dict[str, int], hold: float) -> None:
        self.followers.park(None, peer, rid, min(hold, MAX_HOLD), Follow(streams, offsets),
                            self.answer_follower)
        if self.follow_timer is None:
            self.follow_timer = self.timers.at(time.monotonic() + FOLLOW_POLL, self.follow_tick)

    def follow_tick(self) -> None:
        self.follow_timer = None
        self.wake_followers()
        if len(self.followers):
            self.follow_timer = self.timers.at(time.monotonic() + FOLLOW_POLL, self.follow_tick)

    def answer_follower(self, f: Parked[Follow], *, force: bool = True,
                        upgrading: bool = False) -> bool:
        """Answer ``f`` if it has news (or ``force``); True if it was answered."""
        try:
            res = handlers_output.follow_result(self, f.value.streams, f.value.offsets)
        except TetherError as exc:  # e.g. the file shrank below the offset
            reply = protocol.error(f.rid, exc)
        else:
            if not force and not handlers_output.has_news(res):
                return False
            if upgrading:
                res["upgrading"] = True
            self.note_stream(f.peer, "output", bool(res["ended"]))
            reply = protocol.ok(f.rid, res)
        self.reply(f.peer, reply)
        return True

    def wake_followers(self, *, force: bool = False) -> None:
        """Answer the parked followers that have news (all of them with ``force``)."""
        self.followers.take_if(None, lambda f: self.answer_follower(f, force=force))
        if not len(self.followers) and self.follow_timer is not None:
            self.follow_timer.cancel()
            self.follow_timer = None

    def add_event_waiter(self, peer: Peer, rid: protocol.RequestId, after: int,
                         hold: float) -> None:
        self.event_waiters.park(None, peer, rid, min(hold, MAX_HOLD), after,
                                self.answer_event_waiter)

    def answer_event_waiter(self, w: Parked[int], *, force: bool = True,
                            upgrading: bool = False) -> bool:
        res = handlers_output.events_result(self, w.value)
        if not (force or res["events"] or res["ended"]):
            return False
        if upgrading:
            res["upgrading"] = True
        self.note_stream(w.peer, "events", bool(res["ended"]))
        self.reply(w.peer, protocol.ok(w.rid, res))
        return True

    def wake_event_waiters(self, *, force: bool = False) -> None:
        self.event_waiters.take_if(None, lambda w: self.answer_event_waiter(w, force=force))

    def release_waiters(self) -> None:
        self.step_over()
        for p in self.waiters.take(None):
            self.reply(p.peer, protocol.ok(p.rid, {"done": True, "record": self.record}))

    def add_waiter(self, peer: Peer, rid: protocol.RequestId, hold: float) -> None:
        self.waiters.park(None, peer, rid, min(hold, MAX_HOLD), None,
                          lambda p: self.reply(p.peer, protocol.ok(p.rid, {"done": False})))
