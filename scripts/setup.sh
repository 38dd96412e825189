#!/usr/bin/env bash
# Installs what tether needs on a fresh Debian machine (run as root, or with sudo available).
#   bash scripts/setup.sh          tether itself, and nothing more (what the demo runs on):
#                                  libcap headers for python-prctl, gcc and Python's headers
#                                  (python-prctl is compiled),
#                                  Debian's python3 with venv,
#                                  and a venv at .venv with tether and its dependencies
#   bash scripts/setup.sh --cluster  also postgresql (scripts/demo_cluster.sh starts a throwaway
#                                  server in a temporary directory)
#   bash scripts/setup.sh --tests  also what the tests need (scripts/test.sh): pytest, ruff,
#                                  mypy and prometheus_client (its parser reads the agent's
#                                  metrics file as Prometheus would) in .venv (pyproject's
#                                  `test` extra), and from Debian mpich, libmpich-dev and
#                                  libpmi2-0-dev (real MPI and PMI-2 clients for the PMI tests),
#                                  hwloc-nox (lstopo: the node's topology for MPI ranks),
#                                  postgresql (the cluster tests' server), zsh (the zsh
#                                  completion is loaded by a real zsh), groff-base
#                                  (the man page is rendered) and tmux (`tether top` runs in a
#                                  real terminal) and systemd (`systemd-analyze verify` checks
#                                  contrib/systemd's unit; systemd need not run) and iproute2
#                                  (`ss` sees a listening socket's backlog). Missing, each
#                                  fails the tests that need it (tests/needs.py)
# Debian's /usr/bin/python3 is used (not a pyenv shim): it starts fast and other users can run it.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
packages=(libcap-dev python3-venv python3-dev gcc)
target="."
case "${1:-}" in
    "") ;;
    --cluster) packages+=(postgresql);;
    --tests) packages+=(mpich libmpich-dev libpmi2-0-dev hwloc-nox postgresql zsh groff-base tmux systemd iproute2)
             target=".[test]";;
    *) echo "usage: bash scripts/setup.sh [--cluster|--tests]" >&2; exit 2;;
esac
need=()
for pkg in "${packages[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "setup: installing ${need[*]}" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
    /usr/bin/python3 -m venv .venv
fi
# strict mode: setuptools links each file of the package into build/__editable__.* and a plain
# .pth names that folder. No import hook (the default's finder cost every supervisor ~30 ms), and
# only `tether` is importable: compat mode's .pth named the checkout itself, so the venv also
# imported its top-level folders as `supervisor`, `agent`, `shared` and `cli` (supervisord's
# `supervisor` among them). A module added later needs this script run again (test.sh does).
.venv/bin/python -m pip install -q --disable-pip-version-check -e "$target" \
    --config-settings editable_mode=strict
# setuptools' distutils shim is a .pth that every interpreter start of this venv runs (~1-2 ms
# of each tether command and cold supervisor); nothing here builds packages at run time.
rm -f .venv/lib/python3*/site-packages/distutils-precedence.pth
# pip's console script starts python with `site` (and Debian's sitecustomize) and imports re,
# only to tidy argv[0] for Windows' launchers: ~5 ms of every tether command (docs/cli.md,
# "Start-up"). Ours starts `python -IS` and appends the directories site would have added.
.venv/bin/python scripts/launcher.py .venv/bin/tether
# Bytecode for tether itself, whatever PYTHONDONTWRITEBYTECODE says (it is set on these machines,
# and an editable install ships none): without it every process start is ~30% slower. Compiled
# where the venv imports from: the strict install's link tree (a module's bytecode is looked up
# beside the path it was imported by, the link, not its target), and the checkout's folders,
# which the tests import (compileall does not follow the links in tether/).
links=(build/__editable__.*/tether)
[ -d "${links[0]}" ] || links=()
.venv/bin/python -m compileall -q -j0 "${links[@]}" tether shared supervisor agent cli
