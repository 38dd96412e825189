"""The supervisor's requests: both transports, one dispatch, and the /proc scans some wait for.

The agent speaks through the ROUTER on ``ctl/sock`` (inside a 0700 directory, ctl.py), people
through the door (``sock``); every request from either goes through ``handle`` into
``handlers.dispatch`` (one table, one authorization by the kernel's credentials of the
connection; a handler returns the reply, or the events to feed first, ``act``), and every reply
leaves through ``reply`` by the endpoint it came in on. ``pids`` and ``stats`` need a /proc scan
that begins after the request: it runs on a thread (sweeper.Scan) and the reply is computed on
the loop when the scan is in. A mixin of ``service.Supervisor``; its state is ``state.py``'s.
"""

from __future__ import annotations

import logging
from typing import Any

from tether.shared import protocol
from tether.shared.door import answer
from tether.shared.door_conn import Conn
from tether.shared.errors import TetherError
from tether.supervisor import handlers
from tether.supervisor.ctl import Ctl
from tether.supervisor.machine_events import Act
from tether.supervisor.state import PENDING, Peer, ScanReply, SupervisorState

log = logging.getLogger("tether.supervisor")

#: How long a ``pids`` or ``stats`` request waits for its /proc scan before it is answered busy.
SCAN_HOLD = 10.0


class Requests(SupervisorState):
    """Both transports' requests, their replies and the /proc scans they wait for."""

    def on_door_request(self, conn: Conn, req: protocol.Request) -> None:
        self.handle(conn, req)

    def settle_ctl(self) -> None:
        """After a turn of the loop: the agent's requests whose wake-up a send may have taken
        (ctl.py, "Polling")."""
        if isinstance(self.ctl, Ctl):
            self.ctl.settle()

    def on_door_close(self, conn: Conn) -> None:
        for lot in (self.waiters, self.followers, self.event_waiters, self.claims,
                    self.scan_waiters):
            lot.drop_peer(conn.key)

    def handle(self, peer: Peer, req: protocol.Request) -> None:
        """One request from either transport: the same verbs, the same authorization."""
        answer(lambda: self.act(handlers.dispatch(self, peer, req)), req, peer,
               lambda r: self.reply(peer, r), log, PENDING,
               peer.door if isinstance(peer, Conn) else None)

    def act(self, out: Any) -> Any:
        """A handler's answer: its events fed (effects.py), then its reply."""
        if not isinstance(out, Act):
            return out
        for event in out.events:
            self.feed(event)
        return out.reply(self) if callable(out.reply) else out.reply

    def after_scan(self, peer: Peer, rid: protocol.RequestId, compute: ScanReply) -> None:
        """Answer a request with ``compute(processes)`` from a /proc scan that begins after
        it (``pids``, ``stats``): the scan runs on a thread, the reply is computed here."""
        if not self.scans.busy:
            self.scan_seq += 1
        need = self.scan_seq if not self.scans.busy else self.scan_seq + 1
        self.scans.start()  # now, or as the next one when the running one is in
        self.scan_waiters.park(need, peer, rid, SCAN_HOLD, compute, lambda p: self.reply(
            p.peer, protocol.error(p.rid, TetherError(
                f"reading /proc took longer than {SCAN_HOLD:g}s; try again"))))

    def scanned(self) -> None:
        try:
            procs, failed = self.scans.result(), None
        except OSError as exc:
            procs, failed = [], TetherError(f"cannot read /proc: {exc}")
        for p in self.scan_waiters.take(self.scan_seq):
            try:
                if failed is not None:
                    raise failed
                reply = protocol.ok(p.rid, p.value(procs))
            except TetherError as exc:
                reply = protocol.error(p.rid, exc)
            except Exception:  # as for any handler: a bug is answered, never sent
                log.exception("computing a reply from a /proc scan")
                reply = protocol.error(p.rid, TetherError("internal error"))
            self.reply(p.peer, reply)
        if self.scans.again:
            self.scan_seq += 1
            self.scans.start()

    def reply(self, peer: Peer, reply: protocol.Reply) -> None:
        """By the endpoint ``peer`` came in by (one closed since drops it, as its
        connection's)."""
        if isinstance(peer, Conn):
            if peer.door is not None:
                peer.door.send(peer, reply)
        else:
            peer.door.send(peer, reply)
