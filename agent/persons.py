"""Who each uid is, as the agent's door counts people: a login with its subordinate uids
(``/etc/subuid``, shared/subids.py) is one person, so its share of the door's connections,
buffers, requests in flight and request rate is one share (shared/door_caps.py).

The file is looked at every ``CHECK_EVERY`` seconds (a ``stat``, on the loop: a local file);
when it changed it is read and its owners' names resolved off the loop (the user database may
be LDAP), and the new table is used for the connections accepted from then on. A file that is
refused (not root's, writable by others, too large) is said once in the log and the last good
table stays. ``TETHER_SUBUID_FILE`` points the agent at another file (test-only,
shared/faults.py).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from tether.shared import subids

if TYPE_CHECKING:
    from tether.agent.view import PersonsAgent as Agent

log = logging.getLogger("tether.agent")

#: seconds between two looks at the file's identity
CHECK_EVERY = 2.0


class Persons:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.path = subids.path_from_env()
        self.watch = subids.Watch(self.path)
        self.table = subids.Table()
        self.privileged = frozenset({0, os.getuid()})
        #: a read is under way (off the loop): no other starts meanwhile
        self.reading = False
        self.complained: str | None = None
        self.stopped = False

    def person(self, uid: int) -> int:
        return self.table.person(uid)

    def start(self) -> None:
        self.check()

    def stop(self) -> None:
        self.stopped = True

    def status(self) -> dict[str, Any]:
        return {"file": self.path, "ranges": self.table.size}

    def check(self) -> None:
        """Read the file again if it changed; look again in ``CHECK_EVERY`` seconds."""
        if self.stopped:
            return
        agent = self.agent
        agent.timers.at(time.monotonic() + CHECK_EVERY, self.check)
        if self.reading or not self.watch.changed():
            return
        self.reading = True
        path, privileged = self.path, self.privileged
        try:
            agent.offload.aside(lambda: subids.load(path, privileged), self.loaded,
                                "tether-subuid")
        except RuntimeError:  # no thread to be had now: the next look tries again
            self.reading = False
            self.watch.seen = None

    def loaded(self, table: subids.Table | None, exc: BaseException | None) -> None:
        self.reading = False
        if exc is not None:
            why = str(exc)
            if why != self.complained:
                self.complained = why
                log.error("subordinate uids: cannot use %s (%s); keeping the %d ranges read "
                          "before", self.path, why, self.table.size)
            return
        assert table is not None
        self.complained = None
        if table.size != self.table.size or table.starts != self.table.starts:
            log.info("subordinate uids: %d ranges from %s (each counts as its owner at the "
                     "door)", table.size, self.path)
        self.table = table
