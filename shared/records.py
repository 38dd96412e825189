"""Files on disk: written atomically, read defensively.

Writing: a temporary file created with O_EXCL|O_NOFOLLOW in the target's directory, written,
fsync'd, renamed over the target, then the directory fsync'd. A reader sees the old file or the
new one, never a torn one, and after the call returns the new one survives a power cut.

Reading: O_NOFOLLOW|O_NONBLOCK (a planted symlink or FIFO cannot redirect or block us), must be a
regular file, size-capped, must decode to a JSON object with the expected schema. Anything else
raises ``RecordError`` naming the file and the problem; callers treat that as "no valid record".
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

#: Version of the spec/manifest/sentinel layouts. A reader refuses a schema it does not know.
SCHEMA = 1
MAX_RECORD = 1 << 20
#: One item per line, keys sorted, no indentation: what ``indent`` would give, less the
#: indentation, through json's encoder in C (``indent`` takes its pure-Python one, ~400 calls
#: per record; three records per step in every supervisor, the spec in the agent).
_ENCODE = json.JSONEncoder(sort_keys=True, separators=(",\n", ": ")).encode


class RecordError(ValueError):
    pass


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: str, obj: Any, mode: int = 0o600, *, durable: bool = True) -> None:
    """Replace ``path`` atomically. ``durable=False`` skips both fsyncs: for a file whose only
    readers die with the machine, so that losing it in a power cut changes no decision."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    data = _ENCODE(obj).encode() + b"\n"
    try:
        os.unlink(tmp)  # left by a crash of this very pid's predecessor
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, mode)
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)
    if durable:
        fsync_dir(directory)


def read_json(path: str, *, max_bytes: int = MAX_RECORD) -> dict[str, Any]:
    """Read one JSON object; FileNotFoundError if absent, RecordError if anything is off."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise RecordError(f"{path}: cannot open: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RecordError(f"{path}: not a regular file")
        if st.st_size > max_bytes:
            raise RecordError(f"{path}: {st.st_size} bytes, over the {max_bytes}-byte limit")
        chunks = []
        remaining = max_bytes + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 65536))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise RecordError(f"{path}: grew past the {max_bytes}-byte limit while read")
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise RecordError(f"{path}: nested too deeply") from None
    if not isinstance(obj, dict):
        raise RecordError(f"{path}: not a JSON object")
    if obj.get("schema") != SCHEMA:
        raise RecordError(f"{path}: unknown schema {obj.get('schema')!r} (expected {SCHEMA})")
    return obj


def _need(path: str, obj: dict[str, Any], fields: dict[str, type | tuple[type, ...]]) -> None:
    for name, typ in fields.items():
        value = obj.get(name)
        if not isinstance(value, typ) or isinstance(value, bool) and typ in (int, float):
            raise RecordError(f"{path}: field {name!r} missing or of the wrong type")
        if isinstance(value, int) and not -(1 << 63) <= value < (1 << 63):
            raise RecordError(f"{path}: field {name!r} is out of range")


def _int_list(path: str, obj: dict[str, Any], name: str) -> None:
    value = obj.get(name)
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise RecordError(f"{path}: field {name!r} must be a list of non-negative integers")


def read_spec(path: str) -> dict[str, Any]:
    spec = read_json(path)
    _need(path, spec, {
        "job": int, "attempt": int, "name": str, "command": list, "ntasks": int,
        "env": dict, "workdir": str, "output": str, "error": str, "memory_mb": int,
        "claim_timeout": (int, float), "linger": (int, float), "affinity": list,
        "agent_uid": int,
    })
    _int_list(path, spec, "cpus")
    _int_list(path, spec, "gpus")
    cmd = spec["command"]
    if not cmd or not all(isinstance(a, str) for a in cmd):
        raise RecordError(f"{path}: 'command' must be a non-empty list of strings")
    if spec["ntasks"] < 1 or len(spec["affinity"]) != spec["ntasks"]:
        raise RecordError(f"{path}: 'affinity' must hold one CPU list per task")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in spec["env"].items()):
        raise RecordError(f"{path}: 'env' must map strings to strings")
    xml = spec.get("hwloc_xml")
    if xml is not None and not (isinstance(xml, str) and os.path.isabs(xml) and "\0" not in xml):
        raise RecordError(f"{path}: 'hwloc_xml' must be an absolute path")
    if "uid" in spec:
        _need(path, spec, {"uid": int, "gid": int, "user": str, "home": str})
        _int_list(path, spec, "groups")
    return spec


def read_manifest(path: str) -> dict[str, Any]:
    man = read_json(path)
    _need(path, man, {"job": int, "attempt": int, "phase": str, "supervisor": dict,
                      "tasks": list, "session": int})
    if man["phase"] not in ("ready", "launching", "running"):
        raise RecordError(f"{path}: unknown phase {man['phase']!r}")
    _int_list(path, man, "cpus")
    _int_list(path, man, "gpus")
    return man


SENTINEL_STATES = ("completed", "failed", "cancelled", "timeout", "aborted")


def read_sentinel(path: str) -> dict[str, Any]:
    return check_sentinel(path, read_json(path))


def check_sentinel(path: str, rec: Any) -> dict[str, Any]:
    """An exit record, from a file or a reply; ``path`` names where it came from."""
    if not isinstance(rec, dict):
        raise RecordError(f"{path}: not an object")
    _need(path, rec, {"job": int, "attempt": int, "state": str, "launched": bool})
    if rec["state"] not in SENTINEL_STATES:
        raise RecordError(f"{path}: unknown state {rec['state']!r}")
    if (rec["state"] == "aborted") == rec["launched"]:
        # Only an aborted step launched nothing; anything else claiming otherwise is forged or
        # broken, and taking it at its word could run the job twice.
        raise RecordError(f"{path}: state {rec['state']!r} with launched={rec['launched']}")
    for name, low, high in (("exit_code", 0, 255), ("signal", 1, 127)):
        value = rec.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not low <= value <= high):
            raise RecordError(f"{path}: field {name!r} must be null or an integer from {low} "
                              f"to {high}")
    for name in ("reason", "started_at", "ended_at"):
        if rec.get(name) is not None and not isinstance(rec[name], str):
            raise RecordError(f"{path}: field {name!r} must be text or null")
    for name in ("core_dumped", "oom", "pmi_unused"):
        if not isinstance(rec.get(name, False), bool):
            raise RecordError(f"{path}: field {name!r} must be a boolean")
    return rec
