"""The generated tables in the docs match the code (scripts/doc_tables.py)."""

from __future__ import annotations

import importlib.util
import os


def test_generated_doc_tables_match_the_code() -> None:
    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "doc_tables.py")
    spec = importlib.util.spec_from_file_location("doc_tables", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stale = [p for p, (now, new) in mod.documents().items() if now != new]
    assert not stale, f"stale generated tables in {stale}: run python scripts/doc_tables.py"


def test_the_slurm_comparison_says_of_every_row_present_partial_or_missing() -> None:
    """docs/slurm.md (issue 28): each row of its table ends in present, partial or missing,
    and the count under it is the table's."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "slurm.md")
    with open(path) as f:
        text = f.read()
    table = text.split("## Slurm, row by row", 1)[1].split("\n## ", 1)[0]
    rows = [line.replace("\\|", "") for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| Slurm |")]
    statuses = [row.rstrip().rstrip("|").rsplit("|", 1)[-1].split()[0] for row in rows]
    assert set(statuses) <= {"present", "partial", "missing"}, statuses
    counts = {s: statuses.count(s) for s in ("present", "partial", "missing")}
    assert (f"{len(rows)} rows: {counts['present']} present, {counts['partial']} partial, "
            f"{counts['missing']} missing.") in table
    assert "## What tether has that Slurm lacks" in text
