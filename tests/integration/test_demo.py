"""The demo and its setup (issue 13, friction 10): it installs only what it runs, and colours
only a terminal."""

from __future__ import annotations

import os
import pty
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_writes_no_escape_codes_into_a_pipe() -> None:
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "demo.py")],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "== stopping everything" in res.stdout
    assert "\033" not in res.stdout + res.stderr


def test_demo_headings_are_bold_on_a_terminal() -> None:
    main, sub = pty.openpty()
    try:
        code = f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'scripts')!r}); " \
               "import demo; demo.say('hello')"
        subprocess.run([sys.executable, "-c", code], stdout=sub, timeout=30, check=True,
                       env={k: v for k, v in os.environ.items() if k != "NO_COLOR"})
        assert b"\033[1m== hello\033[0m" in os.read(main, 4096)
    finally:
        os.close(main)
        os.close(sub)


def setup_installs(*args: str) -> tuple[list[str], str]:
    """Run scripts/setup.sh against stand-ins for dpkg, apt-get and the venv's pip (which say
    nothing is installed and record what they are asked): the Debian packages and the pip
    target it asks for."""
    d = tempfile.mkdtemp(dir="/tmp", prefix="ttset")
    try:
        os.makedirs(os.path.join(d, "scripts"))
        shutil.copy(os.path.join(ROOT, "scripts", "setup.sh"), os.path.join(d, "scripts"))
        bin_dir, venv = os.path.join(d, "bin"), os.path.join(d, ".venv", "bin")
        os.makedirs(bin_dir)
        os.makedirs(venv)
        log = os.path.join(d, "log")
        fakes = {os.path.join(bin_dir, "dpkg"): "exit 1",
                 os.path.join(bin_dir, "apt-get"): f'echo "apt-get $*" >> {log}',
                 os.path.join(venv, "python"): f'echo "pip $*" >> {log}'}
        for path, body in fakes.items():
            with open(path, "w") as f:
                f.write(f"#!/bin/sh\n{body}\n")
            os.chmod(path, 0o755)
        res = subprocess.run(["bash", os.path.join(d, "scripts", "setup.sh"), *args],
                             capture_output=True, text=True, timeout=30,
                             env=dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin"))
        assert res.returncode == 0, res.stderr
        with open(log) as f:
            lines = f.read().splitlines()
    finally:
        shutil.rmtree(d)
    apt = [w for line in lines if line.startswith("apt-get install") for w in line.split()
           if not w.startswith("-") and w not in ("apt-get", "install")]
    pip = next(line for line in lines if line.startswith("pip"))
    return apt, pip


def test_setup_for_the_demo_installs_only_tether() -> None:
    apt, pip = setup_installs()
    assert sorted(apt) == ["gcc", "libcap-dev", "python3-dev", "python3-venv"]
    assert " -e . " in pip + " "


def test_setup_for_the_tests_adds_their_tools() -> None:
    apt, pip = setup_installs("--tests")
    assert {"mpich", "libmpich-dev", "libpmi2-0-dev", "zsh", "groff-base", "tmux"} <= set(apt)
    assert " -e .[test] " in pip + " "
