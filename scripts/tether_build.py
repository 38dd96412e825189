"""The build backend: setuptools', with each wheel built in a scratch directory of its own.

setuptools copies the packages into its build directory and then packs *everything* it finds
there into the wheel. A ``build/`` left in a checkout by an older build (one that installed the
top-level packages ``supervisor``, ``agent``, ``shared``, ``cli``) would put those back into a
new wheel, next to ``tether``, and a top-level ``supervisor`` overwrites supervisord's. Deleting
``build/`` first (as this backend did) broke something else: a checkout's ``build/`` also holds
the links of its editable install (``scripts/setup.sh``), so ``pip install .`` from a developer's
checkout broke that checkout's venv (issue 28). So a wheel is built in a fresh temporary
directory (``TETHER_BUILD_BASE``, read by setup.py: setuptools' build directory and its
egg-info), and ``build/`` is left alone. An editable build still starts from an empty
``build/``: it is the one that makes those links.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # noqa: F401  (the rest of the PEP 517 interface)
    build_sdist,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)


def _clean() -> None:
    """An empty ``build/`` for the editable build, which writes its links there."""
    # The backend runs with the project's root as its working directory (PEP 517).
    if os.path.isdir("build") and not os.path.islink("build"):
        shutil.rmtree("build")


def build_wheel(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                metadata_directory: str | None = None) -> str:
    with tempfile.TemporaryDirectory(prefix="tether-build-") as scratch:
        before = os.environ.get("TETHER_BUILD_BASE")
        os.environ["TETHER_BUILD_BASE"] = scratch
        try:
            return str(_setuptools.build_wheel(wheel_directory, config_settings,
                                               metadata_directory))
        finally:
            if before is None:
                del os.environ["TETHER_BUILD_BASE"]
            else:
                os.environ["TETHER_BUILD_BASE"] = before


def build_editable(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                   metadata_directory: str | None = None) -> str:
    _clean()
    return str(_setuptools.build_editable(wheel_directory, config_settings, metadata_directory))
