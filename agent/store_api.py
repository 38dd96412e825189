"""What the database's neighbours use of it: the part of db.py's ``Store`` that acct.py,
batch.py and schema.py call, as a protocol for the type checker. Pure.

Named here rather than imported from db.py, which imports schema.py (to migrate at open) and so,
through the migrations, acct.py and batch.py: typing them with ``db.Store`` closed an import
cycle. ``Store`` satisfies this protocol structurally; nothing subclasses it.
"""

from __future__ import annotations

import sqlite3
from typing import Any, Protocol


class StoreApi(Protocol):
    conn: sqlite3.Connection

    def _exec(self, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Cursor: ...

    def states_of(self, ids: set[int], table: str = "jobs",
                  key: str = "id") -> dict[int, str]: ...

    def begin(self) -> None: ...

    def commit(self) -> None: ...

    def rollback(self) -> None: ...
