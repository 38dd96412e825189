"""The parser read back as data, for completion scripts and the man page (always in step)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass
class Option:
    names: list[str]
    metavar: str | None  # None: a flag without a value
    help: str
    choices: list[str] = field(default_factory=list)


@dataclass
class Command:
    name: str
    summary: str
    description: str
    usage: str
    options: list[Option]
    positionals: list[Option]
    epilog: str


def options_of(parser: argparse.ArgumentParser) -> tuple[list[Option], list[Option]]:
    opts: list[Option] = []
    pos: list[Option] = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction) or a.help == argparse.SUPPRESS:
            continue
        choices = [str(c) for c in a.choices] if a.choices else []
        metavar = None if a.nargs == 0 else str(a.metavar or (
            "{" + ",".join(choices) + "}" if choices else a.dest.upper()))
        help = (a.help or "").replace("%%", "%")
        if a.option_strings:
            opts.append(Option(list(a.option_strings), metavar, help, choices))
        else:
            pos.append(Option([a.dest], metavar, help, choices))
    return opts, pos


def commands(top: argparse.ArgumentParser) -> list[Command]:
    found: list[Command] = []
    for a in top._actions:
        if not isinstance(a, argparse._SubParsersAction):
            continue
        summaries = {c.dest: c.help or "" for c in a._choices_actions}
        for name, sp in a.choices.items():
            opts, pos = options_of(sp)
            usage = sp.format_usage().removeprefix("usage: ").strip()
            found.append(Command(name, summaries.get(name, ""), sp.description or "",
                                 " ".join(usage.split()), opts, pos, sp.epilog or ""))
    return found
