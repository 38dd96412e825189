"""The PMI-1 and PMI-2 wire codec: bytes <-> (command, attributes). Pure: no state, no I/O.

Why a module of its own: the codec is what MPICH's and Slurm's clients dictate byte for byte,
and it is tested on its own (tests/unit/test_pmi_protocol.py); the server (pmi.py) decides what the
messages mean. PMI-1 is one line ``cmd=name k=v k=v\\n``: values without spaces, at most
``MAX_LINE_V1`` bytes with the newline. PMI-2 is a 6-character decimal length (left- or
right-justified: clients and Hydra parse it with atoi), then that many bytes of
``cmd=name;k=v;k=v;`` with ``;`` inside a value doubled. Bytes are decoded as latin-1, so any
byte round-trips and nothing raises on odd input but ``PmiSyntaxError``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

#: PMIU_MAXLINE: the longest PMI-1 line, newline included, that MPICH's client reads or writes.
MAX_LINE_V1 = 1024
#: A PMI-1 line longer than MAX_LINE_V1 is dropped and refused with an error reply; one longer
#: than this is not PMI at all (ProtocolError). Dropped bytes are not buffered.
ABSURD_LINE_V1 = 64 * 1024
#: PMII_MAX_COMMAND_LEN: the longest PMI-2 command body. A larger declared length is fatal.
MAX_COMMAND_V2 = 64 * 1024
#: Width of the PMI-2 length prefix.
V2_HEADER_LEN = 6
#: A PMI-2 length prefix: a decimal number, left- or right-justified with spaces.
V2_HEADER = re.compile(rb" *[0-9]+ *")


class PmiSyntaxError(ValueError):
    """Bytes that are not a PMI message at all."""


class Unencodable(ValueError):
    """A reply that cannot be put in PMI-1 framing (a space or newline in a value, too long)."""


def preview(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def parse_line(line: bytes) -> tuple[str, dict[str, str]]:
    """Split one PMI-1 line (without its newline) into its command and attributes.

    Words are separated by spaces; a key ends at the first ``=``, so values may contain ``=``
    (MPICH sends ``value=segments=2``). If a key repeats, the first wins, as in MPICH's getval.
    """
    text = line.decode("latin-1")
    words = [word for word in text.split(" ") if word]
    if not words or not words[0].startswith("cmd=") or len(words[0]) == 4:
        raise PmiSyntaxError(f"expected a PMI-1 line 'cmd=<name> ...', got {preview(text)}")
    args: dict[str, str] = {}
    for word in words[1:]:
        key, eq, value = word.partition("=")
        if not eq or not key:
            raise PmiSyntaxError(f"expected key=value in a PMI-1 line, got {preview(word)}")
        args.setdefault(key, value)
    return words[0][4:], args


def _scan_v2_value(text: str, start: int) -> tuple[str, int]:
    """Read a PMI-2 value from ``start`` up to its terminating ``;``, undoubling ``;;``.

    Greedy, like MPICH's parse_keyval: ``;;`` is always an escaped ``;``. Returns the value and
    the index after the terminator. A missing final terminator is tolerated.
    """
    parts: list[str] = []
    pos = start
    while True:
        semi = text.find(";", pos)
        if semi < 0:
            parts.append(text[pos:])
            return "".join(parts), len(text)
        parts.append(text[pos:semi])
        if text.startswith(";;", semi):
            parts.append(";")
            pos = semi + 2
            continue
        return "".join(parts), semi + 1


def parse_frame(body: bytes) -> tuple[str, dict[str, str]]:
    """Split one PMI-2 command body (after the length prefix) into command and attributes."""
    text = body.decode("latin-1")
    pairs: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        eq = text.find("=", pos)
        semi = text.find(";", pos)
        if eq < 0 or 0 <= semi < eq or eq == pos:
            raise PmiSyntaxError(f"expected key=value; in PMI-2, got {preview(text[pos:])}")
        value, end = _scan_v2_value(text, eq + 1)
        pairs.append((text[pos:eq], value))
        pos = end
    if not pairs or pairs[0][0] != "cmd" or not pairs[0][1]:
        raise PmiSyntaxError(f"expected a PMI-2 'cmd=<name>;...', got {preview(text)}")
    args: dict[str, str] = {}
    for key, value in pairs[1:]:
        args.setdefault(key, value)
    return pairs[0][1], args


def encode_line(cmd: str, pairs: Sequence[tuple[str, str]]) -> bytes:
    """One PMI-1 line. Raises Unencodable if it would not survive MPICH's parser."""
    words = [f"cmd={cmd}", *(f"{key}={value}" for key, value in pairs)]
    for word in words:
        if " " in word or "\n" in word:
            raise Unencodable(f"{preview(word)} contains a space or newline")
    data = (" ".join(words) + "\n").encode("latin-1")
    if len(data) > MAX_LINE_V1:
        raise Unencodable(f"a {len(data)}-byte line exceeds the {MAX_LINE_V1}-byte PMI-1 limit")
    return data


def encode_frame(cmd: str, pairs: Sequence[tuple[str, str]]) -> bytes:
    """One PMI-2 frame: right-justified 6-char length (Hydra's %6u), every pair ``;``-ended."""
    body = f"cmd={cmd};" + "".join(f"{k}={v.replace(';', ';;')};" for k, v in pairs)
    data = body.encode("latin-1")
    return b"%6d" % len(data) + data
