"""Whose subordinate uids are whose: the ranges of ``/etc/subuid``, so that a door counts every
uid of one person (her own and the subordinate ones ``newuidmap`` lets her take) as one.

A line of the file is ``OWNER:START:COUNT``: the uids START..START+COUNT-1 belong to OWNER, a
user name or a uid (shadow-utils' subuid(5)); comments (``#``) and malformed lines are skipped.
The person of a uid (``Table.person``) is its owner's uid; a uid in no range is its own
person. A range whose owner is privileged (root or the daemon's own uid, which have caps of
their own) is not merged with its owner: its uids are one person of their own, a negative key
(as is an owner name the user database does not know), so that nobody can lock root out
through root's subordinate uids.

The file is read safely (``read``): opened without following a link and without blocking,
and used only if it is a regular file of at most ``MAX_BYTES`` owned by root (or the daemon's
own uid) and writable by no one else; otherwise it is refused and the last good table stays.
Names are resolved through the user database, which may be slow (LDAP): the agent reads the
file off its loop (daemon.py) and only when its identity (device, inode, size, mtime, ctime)
changed (``Watch``). Pure but for ``read``, ``resolve`` and ``Watch.changed``.
"""

from __future__ import annotations

import bisect
import os
import pwd
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass

DEFAULT_PATH = "/etc/subuid"
#: test-only: another file in its place (listed in shared/faults.py)
ENV = "TETHER_SUBUID_FILE"
#: the largest file read (a site with a range for each of 20,000 users is ~600 KB)
MAX_BYTES = 4 << 20
#: the most ranges kept (the rest of a larger file is ignored, and said)
MAX_RANGES = 100_000


class Refused(Exception):
    """The file is not one to trust (its owner, its mode, its kind or size)."""


def path_from_env() -> str:
    return os.environ.get(ENV) or DEFAULT_PATH


@dataclass(frozen=True, slots=True)
class Range:
    owner: str
    start: int
    count: int


def parse(text: str) -> list[Range]:
    """The ranges of a subuid file's text, in file order; malformed lines are skipped."""
    out: list[Range] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(":")
        if len(parts) != 3 or not parts[0]:
            continue
        try:
            start, count = int(parts[1]), int(parts[2])
        except ValueError:
            continue
        if start < 0 or count <= 0 or start + count > 1 << 32:
            continue
        out.append(Range(parts[0], start, count))
        if len(out) >= MAX_RANGES:
            break
    return out


class Table:
    """uid -> person, from ranges whose owners are resolved to uids."""

    def __init__(self, ranges: Iterable[Range] = (), owners: dict[str, int] | None = None,
                 privileged: frozenset[int] = frozenset()) -> None:
        owners = owners or {}
        synthetic: dict[str, int] = {}
        spans: list[tuple[int, int, int]] = []  # (start, end exclusive, person)
        for r in ranges:
            uid = owners.get(r.owner)
            if uid is None or uid in privileged:
                # an unknown owner, or root's own ranges: one person of their own
                uid = synthetic.setdefault(r.owner, -1 - len(synthetic))
            spans.append((r.start, r.start + r.count, uid))
        spans.sort()
        # overlapping ranges: the first by start wins the overlap
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.persons: list[int] = []
        for start, end, person in spans:
            if self.ends and start < self.ends[-1]:
                start = self.ends[-1]
                if start >= end:
                    continue
            self.starts.append(start)
            self.ends.append(end)
            self.persons.append(person)
        #: the number of ranges kept
        self.size = len(self.starts)

    def person(self, uid: int) -> int:
        """The person ``uid`` counts as: the owner of its range, else itself."""
        i = bisect.bisect_right(self.starts, uid) - 1
        if i >= 0 and uid < self.ends[i] and self.persons[i] != uid:
            return self.persons[i]
        return uid


def read(path: str) -> str:
    """The file's text, if it is one a root daemon may trust; raises ``Refused`` or OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{path} is not a regular file")
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            raise Refused(f"{path} must be owned by root and writable by no one else")
        if st.st_size > MAX_BYTES:
            raise Refused(f"{path} is larger than {MAX_BYTES} bytes")
        chunks: list[bytes] = []
        left = MAX_BYTES + 1
        while left > 0 and (data := os.read(fd, min(left, 1 << 16))):
            chunks.append(data)
            left -= len(data)
        if left <= 0:
            raise Refused(f"{path} is larger than {MAX_BYTES} bytes")
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")


def resolve(names: Iterable[str], lookup: Callable[[str], int] | None = None,
            ) -> dict[str, int]:
    """Each owner's uid: a number is one, a name is looked up (the user database: may be
    slow); an unknown name is left out."""
    def by_name(name: str) -> int:
        return pwd.getpwnam(name).pw_uid
    find = lookup or by_name
    out: dict[str, int] = {}
    for name in set(names):
        if name.isdigit():
            out[name] = int(name)
            continue
        try:
            out[name] = find(name)
        except (KeyError, OSError):
            pass
    return out


def load(path: str, privileged: frozenset[int]) -> Table:
    """The table of the file at ``path`` (blocking: the user database). A missing file is an
    empty table; a refused one raises ``Refused``."""
    try:
        text = read(path)
    except FileNotFoundError:
        return Table()
    ranges = parse(text)
    return Table(ranges, resolve(r.owner for r in ranges), privileged)


class Watch:
    """Whether the file changed since it was last read: its identity from ``stat``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: tuple[int, ...] | None = None

    def changed(self) -> bool:
        try:
            st = os.stat(self.path)
            ident: tuple[int, ...] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                      st.st_ctime_ns)
        except OSError:
            ident = ()
        if ident == self.seen:
            return False
        self.seen = ident
        return True
