"""``tether man``: the manual page (roff, section 1) written from the parser itself.

``tether man | man -l -`` reads it; a packager installs ``tether man > tether.1``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import tether
from tether.cli.introspect import Command, Option, commands, every, options_of
from tether.cli.parser import EXIT_CODES, build_parser


def esc(text: str) -> str:
    """Plain text as roff: backslashes, dashes, and no line starting a request."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line[:1] in (".", "'") else line
                     for line in text.split("\n"))


def bold(text: str) -> str:
    return f"\\fB{esc(text)}\\fR"


def option(o: Option) -> list[str]:
    names = ", ".join(bold(n) for n in o.names)
    value = f" \\fI{esc(o.metavar)}\\fR" if o.metavar else ""
    return [".TP", names + value, esc(o.help)]


def block(text: str) -> list[str]:
    """An epilog: its indented lines kept as they are."""
    out: list[str] = []
    for para in re.split(r"\n\s*\n", text.strip()):
        lines = para.split("\n")
        if len(lines) > 1 and lines[0].endswith(":"):
            out += [".PP", bold(lines[0][:-1].capitalize()), ".nf", *(esc(line) for line in
                                                                        lines[1:]), ".fi"]
        else:
            out += [".PP", esc(" ".join(line.strip() for line in lines))]
    return out


def command(c: Command) -> list[str]:
    out = [f".SS {esc(c.name)}", bold(c.usage), ".PP", esc(c.description)]
    for o in c.positionals + c.options:
        if o.names[0] in ("-h", "--help"):
            continue
        out += option(o)
    if c.epilog:
        out += [".RS", *block(c.epilog), ".RE"]
    return out


def page(top: argparse.ArgumentParser, date: str | None = None) -> str:
    """The page; ``date`` (YYYY-MM-DD) for its header, else today's (the installed copy,
    contrib/man/tether.1, keeps the date it was written: scripts/doc_tables.py)."""
    opts, _ = options_of(top)
    date = date or time.strftime("%Y-%m-%d", time.gmtime())
    lines = [
        f'.TH TETHER 1 "{date}" "tether {esc(tether.__version__)}" "User Commands"',
        ".SH NAME", "tether \\- run jobs on a node under per\\-step supervisors",
        ".SH SYNOPSIS", ".nf", bold("tether") + " [\\fB\\-V\\fR] [\\fB\\-\\-state\\-dir\\fR "
        "\\fIDIR\\fR] \\fICOMMAND\\fR [\\fIOPTIONS\\fR] ...",
        ".fi",
        ".SH DESCRIPTION", esc(top.description or ""),
        ".PP", esc("A node agent (tether agent) queues jobs and starts one long-lived supervisor "
                   "per job step; the other commands talk to the agent, and inspect, attach and "
                   "signal to a job's supervisor directly."),
        ".SH OPTIONS",
    ]
    for o in opts:
        if o.names[0] != "-h":
            lines += option(o)
    lines += [".SH COMMANDS"]
    for c in every(commands(top)):  # cluster's actions after it: .SS cluster init
        lines += command(c)
    codes = EXIT_CODES.split("\n")[1:]
    lines += [".SH EXIT STATUS", ".nf", *(esc(line.strip()) for line in codes), ".fi",
              ".SH ENVIRONMENT", ".TP", bold("TETHER_STATE_DIR"),
              esc("the agent's state directory when --state-dir is not given"),
              ".TP", bold("TETHER_CLUSTER"),
              esc("the cluster database's connection string, for tether cluster and a "
                  "cluster member's agent, when --cluster-file is not given (the agent "
                  "removes it from its environment once read)"),
              ".SH FILES", ".TP", bold("/etc/tether/agent.toml"),
              esc("the agent's settings (tether agent --help); options on the command line "
                  "override them"),
              ".SH SEE ALSO", "The documentation, installed in share/doc/tether beside "
              "this page's share/man, and in the source's docs/: cli.md, operations.md, "
              "architecture.md."]
    return "\n".join(lines) + "\n"


def man(ns: argparse.Namespace) -> int:
    sys.stdout.write(page(build_parser()))
    return 0
