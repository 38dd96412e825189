"""The tables of docs/protocol.md, docs/architecture.md and docs/cli.md that are generated from
the code: the verbs, the error codes, the agent's lifecycle, the supervisor's phases, the
test-only fault switches, Slurm's options as tether's submit takes them; and whole files written
from the parser that a package installs (``FILES``: the man page, bash's and zsh's completion).

    python scripts/doc_tables.py          # rewrite them in place
    python scripts/doc_tables.py --check  # exit 1 if a document differs
                                          # (tests/unit/test_doc_tables.py)

Each table sits between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``; the prose
around it is written by hand.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tether.agent import api, lifecycle  # noqa: E402
from tether.shared import errors, faults, protocol  # noqa: E402
from tether.supervisor import handlers, machine, step  # noqa: E402

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


def transitions(table: Any = None, states: Any = None) -> str:
    table = lifecycle.TABLE if table is None else table
    states = list(lifecycle.State if states is None else states)
    rows = ["| state | event | transition |", "|---|---|---|"]
    for (state, event), move in sorted(table.items(),
                                       key=lambda kv: (states.index(kv[0][0]),
                                                       kv[0][1].__name__)):
        doc = (move.__doc__ or "").strip().split("\n")[0]
        rows.append(f"| `{state.value}` | `{event.__name__}` | `{move.__name__}`"
                    + (f": {doc}" if doc else "") + " |")
    return "\n".join(rows)


def supervisor_transitions() -> str:
    return transitions(machine.TABLE, machine.State)


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


#: sbatch's options and what each is in ``tether submit``: (Slurm's spelling, tether's names of
#: it, a note). Every name of tether's is checked against the parser; a row without names is
#: an option tether does not have.
SLURM_OPTIONS: list[tuple[str, tuple[str, ...], str]] = [
    ("-n, --ntasks=N", ("-n", "--ntasks"), "the tasks (ranks) of the job's one step, at most "
     "1024"),
    ("--ntasks-per-node=N", ("--ntasks-per-node",), "on one node, the number of tasks; with "
     "`--ntasks`, the same number or refused"),
    ("-c, --cpus-per-task=N", ("-c", "--cpus-per-task", "--cpus"), "CPUs per task"),
    ("--mem=SIZE[K\\|M\\|G\\|T]", ("--mem", "--memory-mb"), "for the whole job (Slurm's per "
     "node: one node); no unit is MiB, K rounds up; `--mem=0` (all of the node's memory) is "
     "refused"),
    ("-G, --gpus=N", ("-G", "--gpus"), "a count for the whole job; no GPU type (`a100:2` is "
     "refused)"),
    ("-J, --job-name=NAME", ("-J", "--job-name", "--name"), "default: the command's base name"),
    ("-o, --output=PATTERN", ("-o", "--output"), "`%j %x %u %A %a %N %t %%` as Slurm's; "
     "other tokens stay as they are"),
    ("-e, --error=PATTERN", ("-e", "--error"), "as `--output`"),
    ("-t, --time=TIME", ("-t", "--time"), "the same notations; at the limit SIGTERM, SIGKILL "
     "after the agent's `--cancel-grace`"),
    ("-D, --chdir=DIR (before Slurm 17.11: --workdir)", ("-D", "--chdir", "--workdir"),
     "default: the current directory"),
    ("--export=ALL\\|NONE\\|VARS", ("--export",), "`NAME` or `NAME=VALUE`, comma-separated (a "
     "value with a comma: `--env`); `NONE` leaves a plain `PATH`; `--env` goes on top"),
    ("-a, --array=SPEC", ("-a", "--array"), "`N-M[:STEP]`, lists, `%MAX`; at most 1000 "
     "elements"),
    ("-d, --dependency=LIST", ("-d", "--dependency"), "`afterok`, `afternotok`, `afterany`, "
     "`after`, `aftercorr` and `singleton`, Slurm's semantics (an array's id: all its "
     "elements together, also as `ID_*`); no `?` (any of), no `+TIME`, no `expand`"),
    ("-b, --begin=TIME", ("-b", "--begin"), "`now+N[s\\|m\\|h\\|d]`, `HH:MM[:SS]`, "
     "`YYYY-MM-DD[THH:MM[:SS]]`"),
    ("-H, --hold", ("-H", "--hold"), "released by `tether release` (Slurm's `scontrol "
     "release`)"),
    ("-W, --wait", ("-W", "--wait"), "exits with the job's exit code"),
    ("--no-requeue", ("--no-requeue",), "on a cluster's node"),
    ("--uid=USER", ("--user",), "root only"),
    ("-N, --nodes", (), "none: a job runs on the node whose agent takes it"),
    ("-p, --partition, -A, --account, -q, --qos", (), "none"),
    ("--mem-per-cpu, --mem-per-gpu", (), "none: `--mem` for the job"),
    ("--gres, --gpus-per-task, --constraint, --exclusive", (), "none"),
    ("-i, --input, --open-mode", (), "none: stdin is `/dev/null`, outputs are truncated"),
    ("--signal, --mail-type, --mail-user", (), "none"),
    ("", ("--pmi", "--env", "--json", "--export-slurm-env"), "tether's own: PMI served by "
     "the step's supervisor, one variable at a time, the job object as JSON, Slurm's names of "
     "the job variables (`SLURM_JOB_ID`, ...) beside tether's, never by default"),
]


def slurm_options() -> str:
    from tether.cli.batch import SBATCH_NAMES
    from tether.cli.parser import build_parser

    sub = build_parser(["submit"]).subcommand("submit")
    known = {o for a in sub._actions for o in a.option_strings}
    rows = ["| Slurm (`sbatch`) | `tether submit` | notes |", "|---|---|---|"]
    shared: set[str] = set()
    for slurm, ours, note in SLURM_OPTIONS:
        missing = [o for o in ours if o not in known]
        if missing:
            raise SystemExit(f"slurm-options: tether submit has no {', '.join(missing)}")
        shared |= set(re.findall(r"--?[a-zA-Z][a-z-]*", slurm)) & set(ours)
        names = ", ".join(f"`{o}`" for o in ours) or "none"
        rows.append(f"| {f'`{slurm}`' if slurm else 'none'} | {names} | {note} |")
    if shared != SBATCH_NAMES:  # what an #SBATCH line may say: exactly the shared names
        raise SystemExit(f"slurm-options: cli/batch.py SBATCH_NAMES differs from the table by "
                         f"{sorted(shared ^ SBATCH_NAMES)}")
    return "\n".join(rows)


TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "slurm-options": ("docs/cli.md", slurm_options),
    "supervisor-verbs": ("docs/protocol.md", supervisor_verbs),
    "agent-verbs": ("docs/protocol.md", agent_verbs),
    "error-codes": ("docs/protocol.md", error_codes),
    "lifecycle-transitions": ("docs/architecture.md", transitions),
    "supervisor-phases": ("docs/architecture.md", supervisor_phases),
    "supervisor-transitions": ("docs/architecture.md", supervisor_transitions),
    "fault-switches": ("docs/architecture.md", fault_switches),
}


def man_page(now: str) -> str:
    """contrib/man/tether.1: ``tether man``, dated as the file now is unless it changed."""
    from tether.cli import manpage
    from tether.cli.parser import build_parser

    m = re.search(r'^\.TH TETHER 1 "([0-9-]+)"', now, re.M)
    kept = manpage.page(build_parser(), m.group(1) if m else None)
    return kept if kept == now else manpage.page(build_parser())


def completion(shell: str) -> Callable[[str], str]:
    def make(now: str) -> str:
        from tether.cli import completion as comp
        from tether.cli.introspect import commands
        from tether.cli.parser import build_parser

        top = build_parser()
        return str(getattr(comp, shell)(top, commands(top)))
    return make


#: whole files generated from the parser, installed under share/ (setup.py's data_files)
FILES: dict[str, Callable[[str], str]] = {
    "contrib/man/tether.1": man_page,
    "contrib/completion/bash/tether": completion("bash"),
    "contrib/completion/zsh/_tether": completion("zsh"),
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
    for rel, write in FILES.items():
        path = os.path.join(ROOT, rel)
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            text = ""
        out[path] = (text, write(text))
    return out


def main(argv: list[str]) -> int:
    stale = []
    for path, (now, new) in documents().items():
        if now == new:
            continue
        if "--check" in argv:
            stale.append(path)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(new)
            print(f"rewrote {path}")
    for path in stale:
        print(f"{path}: generated tables are stale (run python scripts/doc_tables.py)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
