"""What the tests need that ``scripts/setup.sh --tests`` installs: missing, it fails the test
that needs it with the package to install, never skips it (a skip would pass a run that
checked nothing). What no set-up can give (root, a kernel feature, a second CPU) is a skip."""

from __future__ import annotations

import shutil

import pytest


def tool(name: str, package: str) -> str:
    """The path of the program ``name``; fails the calling test when it is missing."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: install Debian's {package} "
                    "(scripts/setup.sh --tests does)", pytrace=False)
    return path
