#!/usr/bin/env bash
# Installs what tether needs on a fresh Debian machine (run as root, or with sudo available):
# libcap headers for python-prctl, Debian's python3 with venv, and a venv at .venv with tether.
# Debian's /usr/bin/python3 is used (not a pyenv shim): it starts fast and other users can run it.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
need=()
# mpich, libmpich-dev, libpmi2-0-dev: real MPI and PMI-2 clients for the PMI tests
# postgresql: the server the cluster tests, demo and benchmark start in a temporary directory
for pkg in libcap-dev python3-venv python3-dev mpich libmpich-dev libpmi2-0-dev postgresql; do
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
# compat mode: a plain path in a .pth, not an import hook (which cost every supervisor ~30 ms)
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' \
    --config-settings editable_mode=compat
# Bytecode for tether itself, whatever PYTHONDONTWRITEBYTECODE says (it is set on these machines,
# and an editable install ships none): without it every process start is ~30% slower. The real
# folders are compiled because compileall does not follow the links in tether/.
.venv/bin/python -m compileall -q -j0 tether shared supervisor agent cli
