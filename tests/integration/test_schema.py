"""The database's schema version: ordered migrations, a backup before them, and an agent that
refuses a schema it does not know without changing a byte of it."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess

import pytest

from tests.helpers import CLI, Node
from tether.agent import db, schema

# release 0.1.0's table as that build created it: unversioned, user_version 0
_V010 = schema._BASELINE.replace(
    "cancel_requested INTEGER NOT NULL DEFAULT 0\n",
    "cancel_requested INTEGER NOT NULL DEFAULT 0,\n    pmi TEXT NOT NULL DEFAULT 'none',\n"
    "    user TEXT,\n    uid INTEGER,\n    gid INTEGER\n")


def _digest(path: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(os.path.dirname(path))):
        if name.startswith(os.path.basename(path)):
            with open(os.path.join(os.path.dirname(path), name), "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _old_db(path: str, version: int = 0) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executescript(_V010)
    conn.execute(
        "INSERT INTO jobs (name, command, state, cpus_per_task, ntasks, gpus_req, memory_mb, "
        "output, error, workdir, env, submitted_at) VALUES ('old', '[\"true\"]', 'completed', "
        "1, 1, 0, 0, '/tmp/o', '/tmp/o', '/tmp', '{}', '2026-01-01T00:00:00Z')")
    conn.execute(f"PRAGMA user_version = {version}")
    conn.close()


def test_fresh_database_is_at_the_current_version(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "t.db")
    store = db.Store(path)
    try:
        assert store.version() == schema.SCHEMA_VERSION
    finally:
        store.close()
    assert not os.path.exists(path + ".v0")  # nothing to back up


def test_unversioned_release_0_1_0_database_migrates_keeping_its_jobs(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "t.db")
    _old_db(path)
    store = db.Store(path)
    try:
        assert store.version() == schema.SCHEMA_VERSION
        assert [j.name for j in store.all()] == ["old"]
    finally:
        store.close()
    backup = sqlite3.connect(path + ".v0")
    try:
        assert backup.execute("SELECT name FROM jobs").fetchall() == [("old",)]
        assert backup.execute("PRAGMA user_version").fetchone() == (0,)
    finally:
        backup.close()
    assert os.stat(path + ".v0").st_mode & 0o077 == 0


def test_a_failing_migration_leaves_the_previous_version_whole(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.path.join(str(tmp_path), "t.db")
    _old_db(path, version=schema.SCHEMA_VERSION)
    broken = schema.Migration("adds a column, then fails", schema.sql(
        "ALTER TABLE jobs ADD COLUMN half TEXT", "SELECT * FROM no_such_table"))
    monkeypatch.setattr(schema, "MIGRATIONS", [*schema.MIGRATIONS, broken])
    monkeypatch.setattr(schema, "SCHEMA_VERSION", schema.SCHEMA_VERSION + 1)
    with pytest.raises(sqlite3.OperationalError):
        db.Store(path)
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone() == (schema.SCHEMA_VERSION - 1,)
        cols = {row[1] for row in conn.execute("PRAGMA table_info(jobs)")}
        assert "half" not in cols
    finally:
        conn.close()


def test_agent_refuses_a_newer_schema_in_one_line_and_changes_nothing(node: Node) -> None:
    newer = schema.SCHEMA_VERSION + 1
    _old_db(node.layout.db, version=newer)
    before = _digest(node.layout.db)
    res = subprocess.run([*CLI, "agent", "--state-dir", node.state, "--cpus", "1"],
                         capture_output=True, text=True, timeout=30, env=node.env)
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert f"schema version {newer}" in lines[0]
    assert f"this build's {schema.SCHEMA_VERSION}" in lines[0]
    assert "Traceback" not in res.stderr
    assert _digest(node.layout.db) == before
    assert not os.path.exists(node.layout.sock)
