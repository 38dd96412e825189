"""The generated tables in the docs match the code (scripts/doc_tables.py)."""

from __future__ import annotations

import importlib.util
import os


def test_generated_doc_tables_match_the_code() -> None:
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "doc_tables.py")
    spec = importlib.util.spec_from_file_location("doc_tables", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stale = [p for p, (now, new) in mod.documents().items() if now != new]
    assert not stale, f"stale generated tables in {stale}: run python scripts/doc_tables.py"
