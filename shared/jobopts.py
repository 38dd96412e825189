"""Slurm's spellings of a job's scheduling options, parsed and checked. Pure.

``--time``: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S`` (sbatch(1)), in seconds.
``--array``: ``0-99``, ``0-99:STEP``, ``1,3,5-7``, any of them followed by ``%MAX``.
``--dependency``: ``afterok:ID[:ID...]``, ``afterany:...``, ``afternotok:...``, comma-separated;
an ID is a job id or ``ARRAY_INDEX`` (one element of an array). A node and a cluster also take
Slurm's ``after:ID`` (started), ``aftercorr:ID`` (an array's elements pairwise) and
``singleton`` (``NODE_KINDS``).
``--begin``: ``now``, ``now+N[s|m|h|d]`` (seconds without a unit), ``HH:MM[:SS]`` (today, or
tomorrow once that time has passed), ``YYYY-MM-DD[THH:MM[:SS]]``, local time.

Each parser raises ``ValueError`` with a message that names what is wrong; the CLI turns it
into a usage error and the agent (which checks again: every local user is hostile) into
``bad_request``.
"""

from __future__ import annotations

import re

#: The longest time limit taken: a year (anything longer is a typo, or "no limit").
MAX_TIME = 366 * 24 * 3600
#: Elements per array and the highest index (Slurm's MaxArraySize defaults to 1001).
MAX_ARRAY = 1000
MAX_INDEX = 999_999
DEPENDENCY_KINDS = ("afterok", "afterany", "afternotok")
#: what one node's agent takes (agent/schedule.py ``dependency_state`` says what each means)
NODE_KINDS = (*DEPENDENCY_KINDS, "after", "aftercorr", "singleton")

_TIME_FORMS = (
    (re.compile(r"(\d+)"), ("m",)),
    (re.compile(r"(\d+):(\d+)"), ("m", "s")),
    (re.compile(r"(\d+):(\d+):(\d+)"), ("h", "m", "s")),
    (re.compile(r"(\d+)-(\d+)"), ("d", "h")),
    (re.compile(r"(\d+)-(\d+):(\d+)"), ("d", "h", "m")),
    (re.compile(r"(\d+)-(\d+):(\d+):(\d+)"), ("d", "h", "m", "s")),
)
_UNIT = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_time(text: str) -> int:
    """A time limit in Slurm's notation, as whole seconds (at least 1)."""
    text = text.strip()
    for form, units in _TIME_FORMS:
        m = form.fullmatch(text)
        if m is None:
            continue
        if len(m.group(0)) > 24:
            break
        seconds = sum(int(v) * _UNIT[u] for v, u in zip(m.groups(), units, strict=True))
        if seconds < 1:
            raise ValueError(f"time limit {text!r} is zero")
        if seconds > MAX_TIME:
            raise ValueError(f"time limit {text!r} is more than a year")
        return seconds
    raise ValueError(f"{text!r} is not a time limit (MINUTES, M:S, H:M:S, D-H, D-H:M or "
                     f"D-H:M:S)")


def format_time(seconds: float) -> str:
    """Seconds as Slurm prints a limit: ``[D-]HH:MM:SS``."""
    s = int(seconds)
    days, s = divmod(s, 86400)
    text = f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days}-{text}" if days else text


def parse_array(text: str) -> tuple[list[int], int | None]:
    """The indices (sorted, distinct) and the most elements running at once (None: no cap)."""
    spec, pct, cap = text.strip().partition("%")
    limit: int | None = None
    if pct:
        if not re.fullmatch(r"\d{1,7}", cap) or int(cap) < 1:
            raise ValueError(f"array {text!r}: %MAX must be a whole number of at least 1")
        limit = int(cap)
    indices: set[int] = set()
    for part in spec.split(","):
        m = re.fullmatch(r"(\d{1,7})(?:-(\d{1,7})(?::(\d{1,7}))?)?", part.strip())
        if m is None:
            raise ValueError(f"array {text!r}: {part!r} is not N, N-M or N-M:STEP")
        first = int(m.group(1))
        last = first if m.group(2) is None else int(m.group(2))
        step = 1 if m.group(3) is None else int(m.group(3))
        if last < first:
            raise ValueError(f"array {text!r}: {part!r} ends before it starts")
        if step < 1:
            raise ValueError(f"array {text!r}: the step in {part!r} must be at least 1")
        if last > MAX_INDEX:
            raise ValueError(f"array {text!r}: indices go up to {MAX_INDEX}")
        if (last - first) // step + 1 + len(indices) > MAX_ARRAY:
            raise ValueError(f"array {text!r}: more than {MAX_ARRAY} elements")
        indices.update(range(first, last + 1, step))
    return sorted(indices), limit


def parse_job_ref(text: str) -> tuple[int, int | None]:
    """``ID`` or ``ARRAY_INDEX`` (Slurm's ``12_3``): the id and the index, if any."""
    m = re.fullmatch(r"([1-9]\d{0,17})(?:_(\d{1,7}))?", text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a job id (ID or ARRAY_INDEX)")
    return int(m.group(1)), None if m.group(2) is None else int(m.group(2))


def parse_dependency(text: str, kinds: tuple[str, ...] = DEPENDENCY_KINDS,
                     ) -> list[tuple[str, int, int | None]]:
    """(kind, job id, array index or None) for each job named, in order; ``singleton`` names
    none and is ``("singleton", 0, None)``. ``ID_*`` is Slurm's spelling of a whole array
    (``ID``)."""
    deps: list[tuple[str, int, int | None]] = []
    if "?" in text:
        raise ValueError(f"dependency {text!r}: '?' (any of) is not supported; use ','")
    for part in text.strip().split(","):
        kind, _, ids = part.strip().partition(":")
        if kind not in kinds:
            raise ValueError(f"dependency {text!r}: {kind!r} is not one of "
                             f"{', '.join(kinds)}")
        if kind == "singleton":
            if ids:
                raise ValueError(f"dependency {text!r}: singleton names no job")
            deps.append((kind, 0, None))
            continue
        if not ids:
            raise ValueError(f"dependency {text!r}: {kind} names no job ({kind}:ID)")
        for ref in ids.split(":"):
            try:
                job, index = parse_job_ref(ref.removesuffix("_*"))
            except ValueError as exc:
                raise ValueError(f"dependency {text!r}: {exc}") from None
            if ref.endswith("_*") and index is not None:
                raise ValueError(f"dependency {text!r}: {ref!r} is not a job id")
            deps.append((kind, job, index))
    if len(deps) > 1000:
        raise ValueError(f"dependency {text!r}: more than 1000 jobs")
    return deps


def array_facts(indices: list[int]) -> dict[str, str]:
    """An array's variables, the same in each element's environment (Slurm's
    ``SLURM_ARRAY_TASK_COUNT``, ``_MIN``, ``_MAX``, ``_STEP``): ``indices`` sorted; the step
    is the distance between neighbours when every one is the same, else 1."""
    steps = {b - a for a, b in zip(indices, indices[1:], strict=False)}
    return {"TETHER_ARRAY_TASK_COUNT": str(len(indices)),
            "TETHER_ARRAY_TASK_MIN": str(indices[0]), "TETHER_ARRAY_TASK_MAX": str(indices[-1]),
            "TETHER_ARRAY_TASK_STEP": str(steps.pop() if len(steps) == 1 else 1)}


_BEGIN_UNITS = {"": 1, "s": 1, "sec": 1, "seconds": 1, "m": 60, "min": 60, "minutes": 60,
                "h": 3600, "hour": 3600, "hours": 3600, "d": 86400, "day": 86400,
                "days": 86400}


def parse_begin(text: str, now: float) -> float:
    """When a job may start, as epoch seconds (``now``: the caller's clock, epoch seconds)."""
    t = text.strip()
    m = re.fullmatch(r"now(?:\+(\d{1,9})([a-z]*))?", t)
    if m:
        if m.group(1) is None:
            return now
        unit = _BEGIN_UNITS.get(m.group(2))
        if unit is None:
            raise ValueError(f"begin time {text!r}: unknown unit {m.group(2)!r} (s, m, h, d)")
        when = now + int(m.group(1)) * unit
    elif re.fullmatch(r"\d{1,2}:\d{2}(:\d{2})?", t):
        from datetime import datetime, timedelta  # only here: ~1 ms of every submit otherwise

        parts = [int(x) for x in t.split(":")] + [0]
        base = datetime.fromtimestamp(now)
        try:
            day = base.replace(hour=parts[0], minute=parts[1], second=parts[2], microsecond=0)
        except ValueError:
            raise ValueError(f"begin time {text!r} is not a time of day") from None
        if day.timestamp() <= now:
            day += timedelta(days=1)
        when = day.timestamp()
    elif re.fullmatch(r"\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}(:\d{2})?)?", t):
        from datetime import datetime

        try:
            when = datetime.fromisoformat(t).timestamp()
        except ValueError:
            raise ValueError(f"begin time {text!r} is not a date") from None
    else:
        raise ValueError(f"{text!r} is not a begin time (now, now+N[s|m|h|d], HH:MM[:SS] or "
                         f"YYYY-MM-DD[THH:MM[:SS]])")
    if when > now + MAX_TIME:
        raise ValueError(f"begin time {text!r} is more than a year away")
    return when
