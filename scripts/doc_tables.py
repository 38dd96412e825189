"""The tables of docs/protocol.md and docs/architecture.md that are generated from the code:
the verbs, the error codes, the agent's lifecycle, the supervisor's phases, the test-only
fault switches.

    python scripts/doc_tables.py          # rewrite them in place
    python scripts/doc_tables.py --check  # exit 1 if a document differs (tests/test_doc_tables.py)

Each table sits between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``; the prose
around it is written by hand.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tether.agent import api, lifecycle  # noqa: E402
from tether.shared import errors, faults, protocol  # noqa: E402
from tether.supervisor import handlers, step  # noqa: E402

WHO = {handlers.ANY: "any local user", handlers.OWNER: "the job's owner, root, the agent",
       handlers.AGENT: "root, the agent"}


def supervisor_verbs() -> str:
    rows = ["| verb | who may call it | since protocol version |", "|---|---|---|"]
    for kind in sorted(handlers.HANDLERS):
        cls = handlers.VERB_CLASS.get(kind, handlers.AGENT)
        rows.append(f"| `{kind}` | {WHO[cls]} | {protocol.KIND_SINCE.get(kind, '?')} |")
    return "\n".join(rows)


def agent_verbs() -> str:
    rows = ["| verb | since protocol version |", "|---|---|"]
    for kind in sorted(api.HANDLERS):
        rows.append(f"| `{kind}` | {protocol.KIND_SINCE.get(kind, '?')} |")
    return "\n".join(rows)


def error_codes() -> str:
    rows = ["| code | class |", "|---|---|"]
    for code, cls in sorted(errors.ERROR_CODES.items()):
        rows.append(f"| `{code}` | `{cls.__name__}` |")
    return "\n".join(rows)


def transitions() -> str:
    rows = ["| state | event | transition |", "|---|---|---|"]
    for (state, event), move in sorted(lifecycle.TABLE.items(),
                                       key=lambda kv: (list(lifecycle.State).index(kv[0][0]),
                                                       kv[0][1].__name__)):
        doc = (move.__doc__ or "").strip().split("\n")[0]
        rows.append(f"| `{state.value}` | `{event.__name__}` | `{move.__name__}`"
                    + (f": {doc}" if doc else "") + " |")
    return "\n".join(rows)


def supervisor_phases() -> str:
    rows = ["| phase | may move to |", "|---|---|"]
    for phase in step.Phase:
        nxt = ", ".join(f"`{p.value}`" for p in step.Phase if p in step.NEXT[phase])
        rows.append(f"| `{phase.value}` | {nxt or 'nothing (final)'} |")
    return "\n".join(rows)


def fault_switches() -> str:
    rows = ["| variable | read by | effect |", "|---|---|---|"]
    for f in faults.FAULTS:
        rows.append(f"| `{f.variable}={f.name}` | {f.reader} | {f.effect} |")
    return "\n".join(rows)


TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "supervisor-verbs": ("docs/protocol.md", supervisor_verbs),
    "agent-verbs": ("docs/protocol.md", agent_verbs),
    "error-codes": ("docs/protocol.md", error_codes),
    "lifecycle-transitions": ("docs/architecture.md", transitions),
    "supervisor-phases": ("docs/architecture.md", supervisor_phases),
    "fault-switches": ("docs/architecture.md", fault_switches),
}


def render(text: str, name: str, table: str) -> str:
    pattern = re.compile(rf"(<!-- generated: {re.escape(name)} -->\n).*?(<!-- end generated -->)",
                         re.S)
    if not pattern.search(text):
        raise SystemExit(f"no '<!-- generated: {name} -->' block to fill")
    return pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), text)


def documents() -> dict[str, tuple[str, str]]:
    """path -> (text now, text as generated)."""
    out: dict[str, tuple[str, str]] = {}
    for name, (doc, make) in TABLES.items():
        path = os.path.join(ROOT, doc)
        if path not in out:
            with open(path) as f:
                text = f.read()
            out[path] = (text, text)
        now, new = out[path]
        out[path] = (now, render(new, name, make()))
    return out


def main(argv: list[str]) -> int:
    stale = []
    for path, (now, new) in documents().items():
        if now == new:
            continue
        if "--check" in argv:
            stale.append(path)
        else:
            with open(path, "w") as f:
                f.write(new)
            print(f"rewrote {path}")
    for path in stale:
        print(f"{path}: generated tables are stale (run python scripts/doc_tables.py)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
