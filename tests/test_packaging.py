"""What ``pip install .`` puts into a clean venv: the package ``tether``, its dist-info and the
``tether`` command, nothing else; beside supervisord's ``supervisor``, neither harming the other,
even when an older build left its top-level packages in the checkout's ``build/``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

import tether
from tests.releases import PIP, ROOT, make_venv, pip_install, site_packages


@pytest.fixture
def scratch() -> Iterator[str]:
    path = tempfile.mkdtemp(dir="/tmp", prefix="ttpk")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _checkout_with_stale_build(dest: str) -> str:
    """A copy of this checkout's files, plus a build/ an older build of tether left behind."""
    src = os.path.join(dest, "src")
    files = subprocess.run(["git", "-C", ROOT, "ls-files", "-co", "--exclude-standard", "-z"],
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        path = os.path.join(ROOT, rel)
        if os.path.lexists(path):
            os.makedirs(os.path.dirname(os.path.join(src, rel)), exist_ok=True)
            if os.path.islink(path):
                os.symlink(os.readlink(path), os.path.join(src, rel))
            else:
                shutil.copy2(path, os.path.join(src, rel))
    for pkg in ("supervisor", "agent", "shared", "cli"):
        stale = os.path.join(src, "build", "lib", pkg)
        os.makedirs(stale)
        with open(os.path.join(stale, "__init__.py"), "w") as f:
            f.write("STALE = True\n")
    return src


def test_pip_install_puts_only_tether_beside_supervisord(scratch: str) -> None:
    src = _checkout_with_stale_build(scratch)
    python = make_venv(os.path.join(scratch, "venv"))
    site = site_packages(python)
    bindir = os.path.dirname(python)
    pip_install(python, "supervisor", "pyzmq", "msgpack", "setproctitle", "python-prctl",
                "rich", "psycopg[binary]")
    before_site, before_bin = set(os.listdir(site)), set(os.listdir(bindir))

    pip_install(python, src)  # what an operator types: pip install . (the stale build/ too)

    added = set(os.listdir(site)) - before_site
    assert added == {"tether", f"tether-{tether.__version__}.dist-info"}, added
    assert set(os.listdir(bindir)) - before_bin == {"tether"}
    assert set(os.listdir(site)) >= before_site  # nothing of supervisord's was replaced away
    res = subprocess.run([os.path.join(bindir, "tether"), "--version"], capture_output=True,
                         text=True, cwd="/")
    assert res.returncode == 0 and res.stdout.split()[:2] == ["tether", tether.__version__], res
    # both import, each its own: supervisord's package and tether's supervisor
    code = ("import supervisor.supervisord, tether.supervisor.service, tether; "
            "print(supervisor.__file__); print(tether.__file__)")
    res = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, cwd="/")
    assert res.returncode == 0, res.stderr
    assert [os.path.dirname(p) for p in res.stdout.split()] == [
        os.path.join(site, "supervisor"), os.path.join(site, "tether")]
    # and removing supervisord leaves tether whole
    pip_uninstall = [*PIP, "--python", python, "uninstall", "-y", "supervisor"]
    assert subprocess.run(pip_uninstall, capture_output=True).returncode == 0
    res = subprocess.run([python, "-I", "-c", "import tether.supervisor.service"],
                         capture_output=True, text=True, cwd="/")
    assert res.returncode == 0, res.stderr





def test_the_development_venv_imports_only_tether_from_the_checkout() -> None:
    """The venv `scripts/setup.sh` makes (an editable install) adds no import hook and puts
    none of the checkout's top-level folders on the path: in compat mode its .pth named the
    checkout, so any interpreter of the venv imported tether's `supervisor/` as `supervisor`."""
    probe = ("import importlib.util as u, sys\n"
             "print(*[n for n in ('supervisor', 'agent', 'shared', 'cli', 'tests', 'bench')"
             " if u.find_spec(n) is not None], sep=',')\n"
             "print(u.find_spec('tether').origin)\n"
             "print(*[type(f).__name__ for f in sys.meta_path], sep=',')")
    top, origin, finders = subprocess.run(
        [sys.executable, "-I", "-c", probe], cwd="/", capture_output=True, text=True,
        check=True).stdout.splitlines()
    assert top == "", f"top-level names importable from the dev venv: {top}"
    assert os.path.realpath(origin) == os.path.realpath(tether.__file__)
    assert "Editable" not in finders, f"an import hook: {finders}"
