"""Real builds of tether for skew and packaging tests: venvs made from /usr/bin/python3.

Building costs seconds, so what is built is cached under /tmp between test runs, keyed by what it
was built from (a commit, the wheel's dependencies), behind a flock so that parallel test runs
build it once. The first build is quick too: the dependencies come from one wheelhouse, itself
filled from pip's own cache (only python-prctl is ever compiled, once).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
#: tether's dependencies, setuptools (to build) and supervisord (to install beside tether)
DEPS = ("pyzmq", "msgpack", "setproctitle", "python-prctl", "rich", "psycopg[binary]",
        "setuptools", "supervisor")
WHEELHOUSE = (f"/tmp/tether-wheelhouse-py{sys.version_info[0]}{sys.version_info[1]}-"
              + hashlib.sha256(" ".join(DEPS).encode()).hexdigest()[:8])
#: release 0.1.0: the last build of the history before versions meant something
RELEASE_0_1_0 = "72fa3ec"


@contextmanager
def _locked(path: str) -> Iterator[None]:
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _run(cmd: list[str], what: str, **kw: object) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)  # type: ignore
    if res.returncode != 0:
        raise AssertionError(f"{what} failed ({res.returncode}): {res.stderr[-3000:]}")


def wheelhouse() -> str:
    """A directory holding a wheel of every dependency (and of setuptools, for building)."""
    with _locked(WHEELHOUSE):
        if not os.path.exists(os.path.join(WHEELHOUSE, ".complete")):
            tmp = tempfile.mkdtemp(dir="/tmp", prefix="ttwh")
            try:
                _run([*PIP, "wheel", "--use-pep517", "-w", tmp, *DEPS], "pip wheel")
                open(os.path.join(tmp, ".complete"), "w").close()
                shutil.rmtree(WHEELHOUSE, ignore_errors=True)
                os.rename(tmp, WHEELHOUSE)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return WHEELHOUSE


def make_venv(path: str) -> str:
    """A venv from Debian's python without pip (ours drives it); returns its interpreter."""
    _run(["/usr/bin/python3", "-m", "venv", "--without-pip", path], "venv")
    return os.path.join(path, "bin", "python")


def pip_install(python: str, *what: str, deps: bool = True) -> None:
    args = [*PIP, "--python", python, "install", "--no-index", "--find-links", wheelhouse()]
    _run([*args, *([] if deps else ["--no-deps"]), *what], f"pip install {' '.join(what)}")


def site_packages(python: str) -> str:
    venv = os.path.dirname(os.path.dirname(python))
    v = sys.version_info
    return os.path.join(venv, "lib", f"python{v[0]}.{v[1]}", "site-packages")


def release(commit: str = RELEASE_0_1_0) -> str:
    """The venv of the build of ``commit`` from this checkout's history; returns its bin dir."""
    full = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", commit + "^{commit}"],
                          capture_output=True, text=True, check=True).stdout.strip()
    base = f"/tmp/tether-release-{full[:12]}-py{sys.version_info[0]}{sys.version_info[1]}"
    with _locked(base):
        if not os.path.exists(os.path.join(base, ".complete")):
            shutil.rmtree(base, ignore_errors=True)
            os.makedirs(os.path.join(base, "src"))
            # the pipe's reading end is closed here, not left to the garbage collector: on a
            # fresh machine (the first build) its ResourceWarning failed whichever test ran next
            with subprocess.Popen(["git", "-C", ROOT, "archive", full],
                                  stdout=subprocess.PIPE) as archive:
                _run(["tar", "-x", "-C", os.path.join(base, "src")], "tar",
                     stdin=archive.stdout)
            assert archive.returncode == 0, f"git archive {full} failed"
            python = make_venv(os.path.join(base, "venv"))
            pip_install(python, os.path.join(base, "src"))
            shutil.rmtree(os.path.join(base, "src"))
            os.chmod(base, 0o755)
            open(os.path.join(base, ".complete"), "w").close()
    return os.path.join(base, "venv", "bin")
