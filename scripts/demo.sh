#!/usr/bin/env bash
# The main demo: jobs survive an agent SIGKILL and report their true exit codes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py
