"""The agent as a well-behaved service (issue 28, point 5): SIGHUP reloads its settings instead
of stopping it; its supervisor template ends once the agent is stopped for good, or when no
agent came back within the template's linger; `status` names the template; the systemd unit
restarts the agent on any exit but a stop and reloads it with SIGHUP."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from typing import Any

from tests import needs
from tests.helpers import Node, pid_alive, poll_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o644)  # a root agent refuses a settings file others could write


def log_of(node: Node) -> str:
    with open(node.agent_logs[-1]) as f:
        return f.read()


def log_line(node: Node, words: str, after: int = 0) -> str:
    """The first line of the agent's current log with ``words`` in it, after ``after`` such
    lines (polled: the agent logs as it goes). A reload's report is the contract: one log line
    names what changed and what waits for a restart (docs/operations.md), and a refused file
    changes no state to check."""
    def found() -> str | None:
        lines = [ln for ln in log_of(node).splitlines() if words in ln]
        return lines[after] if len(lines) > after else None
    return poll_until(found, 20, f"the agent to log {words!r}")


def test_sighup_reloads_the_settings_and_the_agent_stays_up(node: Node) -> None:
    conf = os.path.join(node.dir, "agent.toml")
    write(conf, 'default-time = "5"\ncancel-grace = 30\n')
    node.args += ["--config", conf]
    node.start()
    pid = node.status()["pid"]
    assert node.job(node.submit("true"))["time_limit"] == 300

    metrics = os.path.join(node.dir, "node.prom")
    write(conf, 'default-time = "10"\nmax-time = "20"\ndefault-memory-mb = 64\n'
          f'log-level = "DEBUG"\nmetrics-file = "{metrics}"\nmetrics-interval = 0.2\n'
          'gpus = 2\ncancel-grace = 7\n')
    assert node.agent is not None
    node.agent.send_signal(signal.SIGHUP)
    line = log_line(node, "settings reloaded")
    # what changed at once, and what waits for a restart, named in one line; cancel-grace is
    # on the command line (the Node's --cancel-grace 2), which the file never overrides
    assert "default-time 600.0" in line and "default-memory-mb 64" in line, line
    assert "log-level DEBUG" in line and "metrics-interval 0.2" in line, line
    assert "not changed without a restart: gpus (0 -> 2)" in line, line
    assert "cancel-grace" not in line, line
    st = node.status()
    assert st["pid"] == pid and node.agent.poll() is None  # the same agent, still serving
    assert st["gpus"]["total"] == 0 and st["cgroup"]["default_memory_mb"] == 64
    job = node.job(node.submit("true"))
    assert job["time_limit"] == 600
    res = node.cli("submit", "--time", "30", "--", "true")
    assert res.returncode == 1 and "maximum" in res.stderr, res.stderr  # max-time 20 minutes
    poll_until(lambda: os.path.exists(metrics), 20, "the metrics file the reload asked for")
    assert " DEBUG " in log_line(node, " DEBUG ")

    # a file the agent would refuse at start changes nothing, and the agent stays
    write(conf, 'gpus = "many"\ndefault-time = "1"\n')
    node.agent.send_signal(signal.SIGHUP)
    line = log_line(node, "cannot reload the settings")
    assert "gpus" in line and "nothing changed" in line, line
    write(conf, 'default-time = "30"\nmax-time = "20"\n')
    node.agent.send_signal(signal.SIGHUP)
    assert "default-time is over max-time" in log_line(node, "nothing changed", after=1)
    assert node.job(node.submit("true"))["time_limit"] == 600
    # metrics turned off again: the file goes (its figures would look live)
    write(conf, 'default-time = "10"\nmax-time = "20"\n')
    node.agent.send_signal(signal.SIGHUP)
    assert "metrics-file none" in log_line(node, "settings reloaded", after=1)
    poll_until(lambda: not os.path.exists(metrics), 20, "the metrics file to be removed")
    assert node.status()["pid"] == pid
    assert node.stop() == 0  # SIGTERM still stops it


def test_the_template_stays_for_a_restart_and_goes_with_stop_for_good(node: Node) -> None:
    node.start()
    template = node.wait_template()
    assert node.status()["template"]["pid"] == template
    assert "template" in node.ok("status") and f"pid {template}" in node.ok("status")
    assert node.stop() == 0
    assert pid_alive(template)  # a plain stop keeps it for the next agent
    node.args.append("--stop-for-good")
    node.start()
    assert node.wait_template() == template  # kept: same code
    assert node.stop() == 0
    poll_until(lambda: not pid_alive(template), 10, "the template to leave with its agent")
    assert not os.path.exists(node.layout.template_sock)


def test_the_template_leaves_once_no_agent_came_back_within_its_linger(node: Node) -> None:
    node.args += ["--template-linger", "1"]
    node.start()
    template = node.wait_template()
    # with an agent running it stays, however short its linger: a job's time later it serves
    job = node.submit("sleep", "1.5")
    assert node.wait_end(job)["state"] == "completed"
    assert pid_alive(template) and node.wait_template() == template
    assert node.stop(signal.SIGKILL) == -signal.SIGKILL  # a crash: no one asks it to leave
    poll_until(lambda: not pid_alive(template), 20, "the template to leave without an agent")
    with open(node.layout.supervisor_log) as f:  # why it left (its linger): only the log says
        assert "no agent has run for 1s; exiting" in f.read()
    node.start()  # the next agent starts a new one
    assert node.wait_template() != template


def test_the_template_of_an_agent_restarted_within_the_linger_stays(node: Node) -> None:
    node.args += ["--template-linger", "2"]
    node.start()
    template = node.wait_template()
    assert node.stop() == 0
    node.start()
    assert node.wait_template() == template
    job = node.submit("sleep", "3")  # longer than the linger, with an agent running again
    assert node.wait_end(job)["state"] == "completed"
    assert pid_alive(template)


# ---- the systemd unit --------------------------------------------------------------------------

def unit() -> dict[str, list[str]]:
    """The unit's settings: key -> values, in order."""
    out: dict[str, list[str]] = {}
    with open(os.path.join(ROOT, "contrib", "systemd", "tether-agent.service")) as f:
        for line in f:
            if "=" in line and not line.startswith(("#", "[")):
                key, _, value = line.strip().partition("=")
                out.setdefault(key, []).append(value)
    return out


def test_the_unit_restarts_on_any_exit_but_a_stop_and_reloads_with_sighup() -> None:
    u = unit()
    assert u["Restart"] == ["always"]
    assert u["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    # a rate limit: an agent that cannot start is not restarted forever
    assert int(u["StartLimitBurst"][0]) > 1 and u["StartLimitIntervalSec"][0]
    assert "--stop-for-good" in u["ExecStart"][0]  # systemctl stop: the template goes too


def test_the_unit_verifies(tmp_path: Any) -> None:
    needs.tool("systemd-analyze", "systemd")
    tether = shutil.which("tether", path=os.path.dirname(sys.executable))
    assert tether is not None
    for name in ("tether-agent.service", "tether.slice"):
        with open(os.path.join(ROOT, "contrib", "systemd", name)) as f:
            text = f.read()
        (tmp_path / name).write_text(text.replace("/usr/local/bin/tether", tether))
    res = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "tether-agent.service"),
                          str(tmp_path / "tether.slice")], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and res.stderr == "", res.stderr


def test_status_json_says_the_template_is_off_when_it_is(node: Node) -> None:
    node.start(env={"TETHER_AGENT_FAULT": "no-template"})
    st: dict[str, Any] = json.loads(node.ok("status", "--json"))
    assert st["template"]["pid"] is None and st["template"]["down"]
