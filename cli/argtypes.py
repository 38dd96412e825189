"""Converters for option values: each rejects bad input with a message naming the problem.

argparse calls them. Each imports what only it needs when called (``re`` for the forms that
parse times), so that the verbs which take none of those forms do not pay for it.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse


def bad_value(message: str) -> argparse.ArgumentTypeError:
    """The error argparse reports as the option's problem (its import only now)."""
    import argparse

    return argparse.ArgumentTypeError(message)


def _whole(text: str, minimum: int, below: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise bad_value(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise bad_value(f"{below}, got {value}")
    return value


def positive(text: str) -> int:
    return _whole(text, 1, "must be at least 1")


def non_negative(text: str) -> int:
    return _whole(text, 0, "must not be negative")


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise bad_value(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise bad_value(f"must be a finite number of seconds >= 0, got {text}")
    return value


def positive_days(text: str) -> float:
    """A number of days above 0 (fractions allowed), as days."""
    try:
        value = float(text)
    except ValueError:
        raise bad_value(f"{text!r} is not a number of days") from None
    if not value > 0 or value == float("inf"):
        raise bad_value(f"must be a finite number of days above 0, got {text}")
    return value


def job_id(text: str) -> int:
    import re

    if not re.fullmatch(r"[1-9][0-9]{0,17}", text):
        raise bad_value(f"{text!r} is not a job id")
    return int(text)


def job_ref(text: str) -> str:
    """``ID`` or ``ARRAY_INDEX`` (an array element, Slurm's ``12_3``), checked, as given."""
    from tether.shared.jobopts import parse_job_ref

    try:
        job, index = parse_job_ref(text)
    except ValueError as exc:
        raise bad_value(str(exc)) from None
    return str(job) if index is None else f"{job}_{index}"


def ref_args(ref: str) -> dict[str, int]:
    """A checked ``job_ref`` as request arguments: ``job``, and ``index`` for an element."""
    job, _, index = ref.partition("_")
    return {"job": int(job), "index": int(index)} if index else {"job": int(job)}


def time_limit(text: str) -> float:
    """Slurm's --time: MINUTES, M:S, H:M:S, D-H, D-H:M or D-H:M:S, as seconds."""
    from tether.shared.jobopts import parse_time

    try:
        return float(parse_time(text))
    except ValueError as exc:
        raise bad_value(str(exc)) from None


def begin_time(text: str) -> float:
    """Slurm's --begin (now+N[s|m|h|d], HH:MM[:SS], YYYY-MM-DD[THH:MM[:SS]]) as epoch
    seconds."""
    import time

    from tether.shared.jobopts import parse_begin

    try:
        return parse_begin(text, time.time())
    except ValueError as exc:
        raise bad_value(str(exc)) from None


def array_spec(text: str) -> str:
    from tether.shared.jobopts import parse_array

    try:
        parse_array(text)
    except ValueError as exc:
        raise bad_value(str(exc)) from None
    return text


def dependency(text: str) -> str:
    from tether.shared.jobopts import NODE_KINDS, parse_dependency

    try:
        parse_dependency(text, NODE_KINDS)  # a cluster's agent refuses the kinds it lacks
    except ValueError as exc:
        raise bad_value(str(exc)) from None
    return text


_NAME_START = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")
_NAME_REST = _NAME_START | frozenset("0123456789")


def env_pair(text: str) -> tuple[str, str]:
    """``KEY=VALUE``, KEY a shell variable's name: ``[A-Za-z_][A-Za-z0-9_]*``."""
    key, sep, value = text.partition("=")
    if not sep or not key or key[0] not in _NAME_START or not _NAME_REST.issuperset(key):
        raise bad_value(f"{text!r} is not KEY=VALUE")
    return key, value


#: Slurm's --mem units (case-insensitive), as MiB per unit; no unit: MiB
_MEM_UNITS = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}


def mem_size(text: str) -> int:
    """Slurm's ``--mem``: a whole number with an optional unit K, M, G or T (any case; no
    unit: MiB), as MiB, rounded up as Slurm does. 0 is refused: to Slurm it means all of the
    node's memory, which a submission cannot name here (docs/cli.md)."""
    digits, unit = (text[:-1], text[-1].lower()) if text[-1:].isalpha() else (text, "m")
    if unit not in _MEM_UNITS or not digits.isascii() or not digits.isdigit():
        raise bad_value(f"{text!r} is not a size: N, or N followed by K, M, G or T")
    kib = int(digits) * int(_MEM_UNITS[unit] * 1024)
    if kib == 0:
        raise bad_value("0 (Slurm's 'all of the node's memory') is not supported: give a "
                        "size, or leave --mem out for the agent's default")
    return -(-kib // 1024)


def export_spec(text: str) -> tuple[str, tuple[tuple[str, str | None], ...]]:
    """Slurm's ``--export``: ``ALL``, ``NONE``, or a comma-separated list of ``NAME`` (taken
    from the submitter's environment) and ``NAME=VALUE``, with ``ALL`` in it to keep the rest of
    the environment too (``ALL`` and ``NONE`` in any case). As (ALL or NONE, the names)."""
    base = ""
    items: list[tuple[str, str | None]] = []
    for part in text.split(","):
        word = part.upper()
        if word in ("ALL", "NONE"):
            if base and base != word:
                raise bad_value(f"{text!r} names both ALL and NONE")
            base = word
            continue
        name, sep, value = part.partition("=")
        if not name or name[0] not in _NAME_START or not _NAME_REST.issuperset(name):
            raise bad_value(f"{part!r} in {text!r} is not NAME or NAME=VALUE (a value with "
                            "a comma: use --env)")
        items.append((name, value if sep else None))
    return base or "NONE", tuple(items)


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (a heartbeat, a timeout)."""
    value = seconds(text)
    if value <= 0:
        raise bad_value(f"must be more than 0 seconds, got {text}")
    return value
