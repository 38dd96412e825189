"""What ``pip install .`` puts into a clean venv: the package ``tether``, its dist-info and the
``tether`` command in site-packages and bin, and the docs, the systemd files, the man page and the
completions under share/; beside supervisord's ``supervisor``, neither harming the other, even
when an older build left its top-level packages in the checkout's ``build/``, and without
touching that ``build/`` (a checkout's editable install keeps its links there). The sdist and
the wheel built from it carry all of that (issue 28, point 7)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator

import pytest

import tether
from tests.releases import PIP, ROOT, make_venv, pip_install, site_packages, wheelhouse

#: what an installation carries under share/ (setup.py's data_files), from its prefix
SHARE = ["share/doc/tether/README.md", "share/doc/tether/LICENSE",
         "share/doc/tether/operations.md", "share/doc/tether/cli.md",
         "share/tether/systemd/tether-agent.service", "share/tether/systemd/tether.slice",
         "share/man/man1/tether.1", "share/bash-completion/completions/tether",
         "share/zsh/site-functions/_tether"]


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
    # and what an editable install keeps there (scripts/setup.sh): its links
    links = os.path.join(src, "build", "__editable__.tether-0-cp311-cp311-linux_x86_64", "tether")
    os.makedirs(links)
    os.symlink(os.path.join(src, "tether", "__init__.py"), os.path.join(links, "__init__.py"))
    return src


def _tree(top: str) -> dict[str, str]:
    """Every file and link under ``top``: its path, and its content or target."""
    out = {}
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                out[os.path.relpath(path, top)] = "-> " + os.readlink(path)
            else:
                with open(path, "rb") as f:
                    out[os.path.relpath(path, top)] = f.read().decode(errors="replace")
    return out


def test_pip_install_puts_only_tether_beside_supervisord(scratch: str) -> None:
    src = _checkout_with_stale_build(scratch)
    python = make_venv(os.path.join(scratch, "venv"))
    site = site_packages(python)
    bindir = os.path.dirname(python)
    pip_install(python, "supervisor", "pyzmq", "msgpack", "setproctitle", "python-prctl",
                "rich", "psycopg[binary]")
    before_site, before_bin = set(os.listdir(site)), set(os.listdir(bindir))
    build_before = _tree(os.path.join(src, "build"))

    pip_install(python, src)  # what an operator types: pip install . (the stale build/ too)

    # the checkout's build/ is as it was: its editable install's links are still there
    assert _tree(os.path.join(src, "build")) == build_before
    prefix = os.path.dirname(bindir)
    missing = [p for p in SHARE if not os.path.isfile(os.path.join(prefix, p))]
    assert not missing, f"not installed under the prefix: {missing}"
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





def test_the_sdist_and_its_wheel_carry_the_docs_units_man_page_and_completions(
        scratch: str) -> None:
    """Both built as ``python -m build`` would (not installed here, and not offline): the sdist
    by the project's own backend, the wheel from the unpacked sdist by pip, in isolation."""
    src = _checkout_with_stale_build(scratch)
    dist = os.path.join(scratch, "dist")
    os.makedirs(dist)
    subprocess.run([sys.executable, "-c", "import sys, tether_build; "
                    "print(tether_build.build_sdist(sys.argv[1]))", dist],
                   cwd=src, env=dict(os.environ, PYTHONPATH=os.path.join(src, "scripts")),
                   check=True, capture_output=True, timeout=300)
    [sdist] = glob.glob(os.path.join(dist, "*.tar.gz"))
    top = f"tether-{tether.__version__}/"
    with tarfile.open(sdist) as tar:
        names = {n.removeprefix(top) for n in tar.getnames()}
        tar.extractall(scratch)  # (our own archive, just built)
    for want in ("LICENSE", "README.md", "pyproject.toml", "setup.py", "MANIFEST.in",
                 "scripts/tether_build.py", "docs/operations.md",
                 "docs/cli.md", "contrib/systemd/tether-agent.service",
                 "contrib/systemd/tether.slice", "contrib/man/tether.1",
                 "contrib/completion/bash/tether", "contrib/completion/zsh/_tether",
                 "agent/daemon.py", "cli/main.py", "shared/protocol.py",
                 "supervisor/template.py", "tether/__init__.py"):
        assert want in names, f"{want} is not in the sdist"
    assert not any(n.startswith(("build/", "tests/", ".venv/")) for n in names)

    res = subprocess.run([*PIP, "wheel", "--no-deps", "--no-index", "--find-links",
                          wheelhouse(), "-w", dist, os.path.join(scratch, top)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    [wheel] = glob.glob(os.path.join(dist, "*.whl"))
    data = f"tether-{tether.__version__}.data/data/"
    info = f"tether-{tether.__version__}.dist-info/"
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        metadata = whl.read(info + "METADATA").decode()
    for want in SHARE:
        assert data + want in names, f"{want} is not in the wheel"
    for want in ("tether/__init__.py", "tether/agent/daemon.py", "tether/cli/main.py",
                 "tether/supervisor/template.py", "tether/shared/protocol.py"):
        assert want in names, f"{want} is not in the wheel"
    assert any(n.startswith(info) and n.endswith("LICENSE") for n in names), names
    assert "License: MIT" in metadata or "License-Expression: MIT" in metadata
    # nothing but tether, its data and its dist-info: the stale build/ stayed out
    assert {n.split("/")[0] for n in names} == {"tether", data.split("/")[0], info[:-1]}


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
