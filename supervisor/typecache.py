"""CPython's type attribute cache, filled in the template with what supervisors look up (memory).

Each attribute lookup on a type that misses CPython's method cache (4,096 entries, on the
interpreter's state) stores the attribute's name in the entry it takes, with a new reference:
a write to the name's string object, an interned string somewhere in the template's heap. A
forked supervisor makes hundreds of such misses in its first milliseconds, each of which copies
the page its name lies on: in one idle supervisor, 375 of the 433 strings whose reference counts
it wrote were names in its cache, on 98 of the 135 pages those strings occupy (bench/README.md).
A lookup that hits the cache writes nothing. (A miss also drops the entry's old name: with the
cache emptied, that is ``None``, one page for all.)

So the template, right after it empties the cache (template.py), looks up again every (type,
name) that supervisors leave in their caches: ``hotcode_list.LOOKUPS``, recorded by
``python -m bench.hotcode`` from real supervisors' caches at their exit (``dump``, under
``TETHER_RECORD_LOOKUPS``). Its forks then start with those entries in place. A stale list costs
memory, never correctness: a name the template no longer finds is skipped, and a supervisor
that misses simply fills the entry itself.

``warm`` calls ``_PyType_Lookup``, the lookup the interpreter itself makes (an exported function
of CPython's C API), through ctypes, so that exactly the entry the supervisor will probe is
filled: no metatype lookups or descriptors run. ``dump`` reads the cache itself, which no API
exposes; it knows CPython 3.11's layout (entries of {version, name, value}, the type's
``tp_version_tag`` at byte 384), checks both on a probe of its own before it trusts them, and
returns nothing elsewhere. It runs only in recording supervisors, never in production.
"""

from __future__ import annotations

import ctypes
import gc
import os
import struct
import sys
import types
from collections.abc import Iterable
from typing import Any

#: a directory: each supervisor forked from the template writes there, as it exits, the
#: entries of its cache (``PID.lookups``, one ``module:qualname name`` a line). Recorded apart
#: from hotcode's ``TETHER_RECORD_CALLS``: under a profile function CPython 3.11 runs every
#: instruction unspecialized, so what is looked up, and when, is not what a supervisor does
RECORD = "TETHER_RECORD_LOOKUPS"
ENTRIES = 4096  # 1 << MCACHE_SIZE_EXP
ENTRY = struct.Struct("IxxxxQQ")  # version, name, value
VERSION_AT = 384  # offsetof(PyTypeObject, tp_version_tag), 64-bit CPython 3.11


_fn: Any = None


def _lookup_fn() -> Any:
    """``_PyType_Lookup`` through ctypes, made once: finding it is itself a few lookups, which
    must not happen between emptying the cache and filling it (``prepare`` makes it first)."""
    global _fn
    if _fn is None:
        fn = getattr(ctypes.pythonapi, "_PyType_Lookup", None)
        if fn is not None:
            fn.restype = ctypes.c_void_p  # a borrowed reference: never made into an object
            fn.argtypes = (ctypes.py_object, ctypes.py_object)
            _fn = fn
    return _fn


def name_of(tp: type) -> str | None:
    """``module:qualname`` that ``resolve`` finds ``tp`` by, or None."""
    qual = getattr(tp, "__qualname__", "")
    if isinstance(qual, str) and "<" not in qual:  # not a local class
        path = f"{tp.__module__}:{qual}"
        if resolve(path) is tp:
            return path
    # the interpreter's own types that builtins does not name (module, function, method...)
    for alias, obj in vars(types).items():
        if obj is tp:
            return f"types:{alias}"
    return None


def resolve(path: str) -> type | None:
    """The type named ``module:qualname``, from modules already imported only."""
    module, _, qual = path.partition(":")
    obj: object = sys.modules.get(module)
    for part in qual.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, type) else None


def prepare(lookups: Iterable[tuple[str, str]]) -> list[tuple[type, str]]:
    """The types of ``lookups`` found, and their names as the interned strings code uses.
    Before the cache is emptied: finding a type looks up its module's attributes by names
    made here, each an entry of its own. Makes ``warm``'s ctypes function, for the same
    reason."""
    _lookup_fn()
    out = []
    for path, name in lookups:
        tp = resolve(path)
        if tp is not None:
            out.append((tp, sys.intern(name)))
    return out


def warm(pairs: list[tuple[type, str]]) -> int:
    """Look up each (type, name) once, and nothing else; how many."""
    fn = _lookup_fn()
    if fn is None:
        return 0
    for tp, name in pairs:
        fn(tp, name)
    return len(pairs)


def _all_types() -> list[type]:
    """Every type this process has: heap types from the collector, static ones by walking
    subclasses from ``object``."""
    seen: dict[int, type] = {}
    todo: list[type] = [object]
    todo += [o for o in gc.get_objects() if isinstance(o, type)]
    while todo:
        tp = todo.pop()
        if id(tp) in seen:
            continue
        seen[id(tp)] = tp
        try:
            todo.extend(type.__subclasses__(tp))
        except TypeError:
            pass
    return list(seen.values())


def _cache_base() -> int | None:
    """Where the cache's entries start, found by a probe of our own; None if not CPython 3.11
    as this module knows it."""
    if sys.implementation.name != "cpython" or sys.version_info[:2] != (3, 11):
        return None
    fn = _lookup_fn()
    if fn is None:
        return None
    api = ctypes.pythonapi
    api.PyInterpreterState_Get.restype = ctypes.c_void_p
    interp: int = api.PyInterpreterState_Get()
    probe = sys.intern("tether_type_cache_probe")
    Probe = type("Probe", (), {probe: 1})
    fn(Probe, probe)
    version = ctypes.c_uint.from_address(id(Probe) + VERSION_AT).value
    index = (version ^ (id(probe) >> 3)) & (ENTRIES - 1)
    # the interpreter state is static (in the executable's .bss) for the main interpreter:
    # read no further than the mapping that holds it
    end = None
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= interp < hi:
                end = hi
    if end is None:
        return None
    raw = ctypes.string_at(interp, end - interp)
    want = struct.pack("IxxxxQ", version, id(probe))
    at = 0
    while (at := raw.find(struct.pack("Q", id(probe)), at + 1)) >= 0:
        entry = interp + at - 8
        if at >= 8 and at % 8 == 0 and raw[at - 8:at - 4] == want[:4]:
            base = entry - index * ENTRY.size
            if base >= interp and base + ENTRIES * ENTRY.size <= end:
                return base
    return None


#: where the cache is, found by ``locate`` before the step runs: finding it looks things up,
#: which at the end would replace entries the step left
_base: int | None = None


def locate() -> None:
    global _base
    _base = _cache_base()


def dump() -> list[tuple[str, str]]:
    """The (type, name) of every entry in this process's cache that can be found again by
    name; [] where the cache's layout is not known (or ``locate`` was not called)."""
    if _base is None:
        return []
    raw = ctypes.string_at(_base, ENTRIES * ENTRY.size)  # first: the cache as it was left
    gc.unfreeze()  # the template's objects, frozen, are not in gc.get_objects() (at exit: moot)
    by_version: dict[int, type] = {}
    for tp in _all_types():
        version = ctypes.c_uint.from_address(id(tp) + VERSION_AT).value
        if version:
            by_version[version] = tp
    names = {id(s): s for s in _names(list(by_version.values()))}
    out: list[tuple[str, str]] = []
    for i in range(ENTRIES):
        version, name_at, _ = ENTRY.unpack_from(raw, i * ENTRY.size)
        found = by_version.get(version)
        name = names.get(name_at)
        path = name_of(found) if found is not None else None
        if path is not None and name is not None:
            out.append((path, name))
    return sorted(out)


def write_record(directory: str) -> None:
    """Write what ``dump`` finds to ``directory/PID.lookups``."""
    lookups = dump()
    with open(os.path.join(directory, f"{os.getpid()}.lookups"), "w") as f:
        f.writelines(f"{path} {name}\n" for path, name in lookups)


def _names(known: list[type]) -> set[str]:
    """Every attribute name code can look up: what every type defines, and the names in every
    code object (the same objects as the cache's: both interned)."""
    found: set[str] = {k for tp in known for k in vars(tp) if isinstance(k, str)}
    todo = [o.__code__ for o in gc.get_objects() if hasattr(o, "__code__")]
    seen: set[int] = set()
    while todo:
        code = todo.pop()
        if id(code) in seen or not hasattr(code, "co_names"):
            continue
        seen.add(id(code))
        found.update(n for n in code.co_names if isinstance(n, str) and n.isidentifier())
        todo.extend(c for c in code.co_consts if hasattr(c, "co_names"))
    return found
