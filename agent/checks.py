"""Submission checks, each on a thread of its own, bounded in time and in number per user.

A submission is checked before it is recorded (api.py ``submit``): who the user is (NSS, which
may be LDAP) and, for a job of another user than the agent's, whether that user can enter the
working directory and write the outputs, asked of the kernel by a short /bin/sh run as her
(users.py ``check_access``). She owns that shell: she can stop it, or point it at a file system
of hers that hangs. So no check may hold up anyone else's:

- every check of a user's job runs on a thread of its own, never behind another user's;
- at most ``PER_USER`` are in flight per (caller, user the job runs as; a caller is a person:
  a login with its subordinate uids, shared/door_caps.py), ``TOTAL`` in all for
  callers other than root and the agent's own uid (whose own have ``PER_PRIVILEGED``); past
  either the submission is refused at once with ``busy`` (to that caller only, for the first);
- a check has a deadline (``agent --submit-check-timeout``): past it users.py kills the check's
  process group and the submission is refused naming it. Should the thread itself be stuck
  (in NSS, or in a kill of a process the kernel holds), the submitter is answered anyway a
  moment later (``GRACE``); the thread keeps its slot until it returns, so a user's stuck
  checks cost her own slots only.

The agent's own user's own jobs need no process (users.py ``check_own_access``): their checks
stay on the worker thread's queue (offload.py), which nobody else's check enters any more.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from tether.agent import users
from tether.agent.offload import Done, Offload
from tether.shared.door_conn import Conn
from tether.shared.errors import Busy, StateError
from tether.shared.timers import Timers

#: checks in flight per (caller's uid, user the job runs as)
PER_USER = 4
#: the same for root's and the agent's own uid's (a root script submitting for many at once)
PER_PRIVILEGED = 64
#: checks in flight in all, for callers other than root and the agent's uid
TOTAL = 32
#: seconds after the deadline the submitter is answered even if the check's thread is stuck
GRACE = 1.0

#: a check: it is given its deadline (``time.monotonic()``) and the timeout it stands for
Check = Callable[[float, float], Any]
Key = tuple[int, str | None]


class Checks:
    def __init__(self, offload: Offload, timers: Timers, timeout: float) -> None:
        self.offload = offload
        self.timers = timers
        #: seconds a check may take (``agent --submit-check-timeout``)
        self.timeout = timeout
        self.by_key: dict[Key, int] = {}
        #: checks in flight of callers other than root and the agent's uid
        self.unprivileged = 0

    def close(self) -> None:
        """The agent is stopping: no check it started may outlive it (a stopped one would)."""
        users.kill_checks()

    def start(self, peer: Conn, user_name: str | None, check: Check, done: Done) -> None:
        """Run ``check`` for ``peer``'s submission (as ``user_name``, root's ``--user``);
        ``done(result, error)`` runs on the loop, once. Raises ``Busy`` over a cap."""
        privileged = peer.uid in (0, os.getuid())
        if privileged and user_name is None and peer.uid == os.geteuid():
            # the agent's own user's job: no process runs as anyone (users.check_own_access)
            timeout = self.timeout
            self.offload.submit(lambda: check(time.monotonic() + timeout, timeout), done,
                                "submissions")
            return
        key = (peer.person, user_name)  # a login and its subordinate uids: one person
        held = self.by_key.get(key, 0)
        cap = PER_PRIVILEGED if privileged else PER_USER
        if held >= cap:
            who = f"uid {peer.uid}" + (f" (as {user_name})" if user_name else "")
            raise Busy(f"{who} has {held} submissions being checked already (at most {cap} "
                       "at once); try again when one is answered")
        if not privileged and self.unprivileged >= TOTAL:
            raise Busy(f"the agent is checking {self.unprivileged} users' submissions already "
                       f"(at most {TOTAL} at once); try again")
        self.by_key[key] = held + 1
        if not privileged:
            self.unprivileged += 1
        timeout = self.timeout  # as it stands now (a reload changes it for later checks)
        deadline = time.monotonic() + timeout
        answered = False

        def answer(result: Any, error: BaseException | None) -> None:
            nonlocal answered
            if not answered:
                answered = True
                done(result, error)

        def expired() -> None:  # the thread is stuck past the deadline: answer without it
            answer(None, StateError(
                f"the check of this submission did not finish within {timeout:g}s (a "
                "hung user database or file system); the job was not submitted"))

        timer = self.timers.at(deadline + GRACE, expired)

        def finished(result: Any, error: BaseException | None) -> None:  # on the loop
            timer.cancel()
            left = self.by_key[key] - 1
            if left:
                self.by_key[key] = left
            else:
                del self.by_key[key]
            if not privileged:
                self.unprivileged -= 1
            answer(result, error)

        try:
            self.offload.aside(lambda: check(deadline, timeout), finished, "tether-check")
        except RuntimeError:  # no thread to be had (the process's or the system's limit)
            answered = True
            finished(None, None)
            raise Busy("the agent cannot start a thread to check this submission; try "
                       "again") from None
