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
    #: its own subcommands (``cluster``'s actions), named ``cluster init`` and so on
    nested: list[Command] = field(default_factory=list)


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


def commands(top: argparse.ArgumentParser, prefix: str = "") -> list[Command]:
    """``top``'s subcommands, each with its own (``nested``) where it has some."""
    found: list[Command] = []
    for a in top._actions:
        if not isinstance(a, argparse._SubParsersAction):
            continue
        summaries = {c.dest: c.help or "" for c in a._choices_actions}
        for name, sp in a.choices.items():
            opts, pos = options_of(sp)
            usage = sp.format_usage().removeprefix("usage: ").strip()
            found.append(Command(prefix + name, summaries.get(name, ""), sp.description or "",
                                 " ".join(usage.split()), opts, pos, sp.epilog or "",
                                 commands(sp, f"{prefix}{name} ")))
    return found


def every(cmds: list[Command]) -> list[Command]:
    """Each command followed by its nested ones, at any depth."""
    return [c2 for c in cmds for c2 in (c, *every(c.nested))]
