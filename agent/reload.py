"""The agent's signals: SIGTERM and SIGINT stop it (every job keeps running), SIGHUP reloads its
settings (I/O).

A reload reads the settings as at start (the same command line parsed again, the settings file
read again: ``cli/agentconf.py``), applies at once what the agent reads as it goes (``LIVE``) and
names in its log line what would need a restart. Nothing changes when the file cannot be read
or has a bad value: the agent says why and keeps every setting as it was. What a reload applies
counts from then on: a job already submitted keeps the time limit it got, a supervisor already
started the claim timeout, linger and grace of its spec (a cancel asked for after the reload
carries the new grace).

SIGHUP stopped the agent before (issue 28): under systemd's ``ExecReload=kill -HUP`` that was a
stop, and with ``Restart=on-failure`` one that was not undone.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tether.agent.view import ReloadAgent as Agent

log = logging.getLogger("tether.agent")


def _cfg(attr: str) -> Callable[[Agent, Any], None]:
    def apply(agent: Agent, value: Any) -> None:
        setattr(agent.cfg, attr, value)
    return apply


def _default_memory(agent: Agent, value: int) -> None:
    agent.cfg.default_memory_mb = value
    agent.contain.default_memory_mb = value  # the limit of each step planned from now on


def _check_timeout(agent: Agent, value: float) -> None:
    agent.cfg.submit_check_timeout = value
    agent.checks.timeout = value  # each check reads it as it starts


def _limit(attr: str) -> Callable[[Agent, Any], None]:
    def apply(agent: Agent, value: Any) -> None:
        setattr(agent.cfg.limits, attr, value)
        agent.schedule_due = True  # the next pass orders and limits by it
    return apply


def _log_level(agent: Agent, value: str) -> None:
    logging.getLogger().setLevel(value)  # cmd_agent set the root logger's level at start


def _service(attr: str) -> Callable[[Agent, Any], None]:
    def apply(agent: Agent, value: Any) -> None:
        if attr == "metrics_file" and value:
            value = os.path.abspath(value)
        setattr(agent.cfg.service, attr, value)
        agent.metrics.configure()
    return apply


#: the settings a reload applies at once (by option name), and how
LIVE: dict[str, Callable[[Agent, Any], None]] = {
    "cancel-grace": _cfg("cancel_grace"), "default-time": _cfg("default_time"),
    "max-time": _cfg("max_time"), "claim-timeout": _cfg("claim_timeout"),
    "linger": _cfg("linger"), "default-memory-mb": _default_memory, "log-level": _log_level,
    "pmi-store-mb": _cfg("pmi_store_mb"), "submit-check-timeout": _check_timeout,
    "stop-for-good": _service("stop_for_good"), "metrics-file": _service("metrics_file"),
    "metrics-interval": _service("metrics_interval"),
    "max-queued-per-user": _limit("max_queued"), "max-running-per-user": _limit("max_running"),
    "max-user-records-mb": _limit("max_records_mb"), "keep-ended": _limit("keep_ended_days"),
    "keep-ended-count": _limit("keep_ended_count"), "fairshare-half-life": _limit("half_life"),
}


def wakeup() -> tuple[socket.socket, socket.socket]:
    """The loop's signal wakeup: SIGTERM, SIGINT and SIGHUP are handled in the loop
    (``on_signals``), through the read end; the caller keeps the write end open."""
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _wake_only)
    return wake_r, wake_w


def _wake_only(signum: int, frame: object) -> None:
    """Handled in the loop, through the wakeup fd."""


def on_signals(agent: Agent, wake_r: socket.socket) -> None:
    try:
        data = wake_r.recv(4096)
    except BlockingIOError:
        return
    for sig in sorted(set(data)):
        if sig == signal.SIGHUP:
            reload(agent)
            continue
        good = agent.cfg.service.stop_for_good
        log.info("received %s: stopping (jobs keep running%s)", signal.Signals(sig).name,
                 "; the supervisor template goes too: --stop-for-good" if good else "")
        agent.stopping = True
        agent.for_good = good


def reload(agent: Agent) -> None:
    """Read the settings again and apply what can change while the agent runs."""
    if agent.reread is None:
        log.warning("received SIGHUP: this agent has no settings to reload; nothing changed")
        return
    try:
        fresh = agent.reread()
    except Exception as exc:  # the file's problem, in the words a start would have used
        log.error("received SIGHUP: cannot reload the settings, nothing changed: %s", exc)
        return
    old = agent.settings
    changed = sorted(k for k, v in fresh.items() if old.get(k) != v)
    default, most = (fresh.get(k, old.get(k)) for k in ("default-time", "max-time"))
    if default is not None and most is not None and default > most:
        log.error("received SIGHUP: default-time is over max-time; nothing changed")
        return
    now = [k for k in changed if k in LIVE]
    for key in now:
        LIVE[key](agent, fresh[key])
        old[key] = fresh[key]
    # the others keep their old value here, so that the next reload names them again
    later = [f"{k} ({_show(old.get(k))} -> {_show(fresh[k])})" for k in changed
             if k not in LIVE]
    # a setting that did not take is worth a warning: whoever changed it expects it to
    log.log(logging.WARNING if later else logging.INFO,
            "received SIGHUP: settings reloaded: %s%s",
            ", ".join(f"{k} {_show(fresh[k])}" for k in now) or "nothing changed",
            f"; not changed without a restart: {', '.join(later)}" if later else "")


def _show(value: Any) -> str:
    return "none" if value is None else str(value)
