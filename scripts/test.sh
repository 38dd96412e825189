#!/usr/bin/env bash
# The whole check: install, lint, type-check, then every test against real processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/pytest -q "$@"
