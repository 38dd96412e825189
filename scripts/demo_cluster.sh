#!/usr/bin/env bash
# The cluster demo: a throwaway PostgreSQL and three agents; a node stopped past the heartbeat
# timeout has its job requeued and completed elsewhere, and kills its stale run on return.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --cluster
exec .venv/bin/python scripts/demo_cluster.py
