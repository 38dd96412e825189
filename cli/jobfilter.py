"""Choosing jobs by state, user, name and time: shared by ``list`` and ``cancel``."""

from __future__ import annotations

from tether.cli.argtypes import bad_value
from tether.cli.timefmt import parse_since, parse_stamp

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterable
    from typing import Any

STATES = ("pending", "starting", "running", "suspended", "completed", "failed", "cancelled",
          "lost", "timeout")
#: Slurm's short state codes and two groups, as ``--state`` also accepts them
ALIASES = {"pd": ("pending",), "r": ("running",), "cd": ("completed",), "f": ("failed",),
           "ca": ("cancelled",), "to": ("timeout",), "s": ("suspended",),
           "active": ("pending", "starting", "running", "suspended"),
           "ended": ("completed", "failed", "cancelled", "lost", "timeout")}


def state_list(text: str) -> frozenset[str]:
    """``--state running,pending`` (names, Slurm's codes, ``active``, ``ended``; any case)."""
    found: set[str] = set()
    for word in (w.strip().lower() for w in text.split(",")):
        if word in STATES:
            found.add(word)
        elif word in ALIASES:
            found.update(ALIASES[word])
        else:
            raise bad_value(
                f"unknown state {word!r}: use {', '.join(STATES)}, active or ended")
    return frozenset(found)


def name_list(text: str) -> frozenset[str]:
    names = frozenset(w for w in text.split(",") if w)
    if not names:
        raise bad_value("expected one or more names, comma-separated")
    return names


def since(text: str) -> float:
    try:
        return parse_since(text)
    except ValueError as exc:
        raise bad_value(str(exc)) from None


def add_filters(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--state", type=state_list, metavar="STATE[,STATE...]",
                        help=f"only {what} in these states: {', '.join(STATES)}, Slurm's codes "
                        "(PD, R, S, CD, F, CA, TO), active (pending, starting, running, suspended) "
                        "or ended")
    parser.add_argument("--user", type=name_list, metavar="USER[,USER...]",
                        help=f"only {what} whose tasks run as these users")
    parser.add_argument("--name", type=name_list, metavar="NAME[,NAME...]",
                        help=f"only {what} with exactly these names")


def select(jobs: Iterable[dict[str, Any]], ns: argparse.Namespace) -> list[dict[str, Any]]:
    """The jobs every given filter lets through, in their order."""
    out = []
    cutoff = getattr(ns, "since", None)
    for j in jobs:
        if ns.state is not None and j["state"] not in ns.state:
            continue
        if ns.user is not None and j.get("user") not in ns.user:
            continue
        if ns.name is not None and j["name"] not in ns.name:
            continue
        if cutoff is not None:
            ended = parse_stamp(j.get("ended_at"))
            if ended is not None and ended < cutoff:
                continue
        out.append(j)
    return out
