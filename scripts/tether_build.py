"""The build backend: setuptools', after removing what an earlier build left in ``build/``.

setuptools copies the packages into ``build/lib`` and then packs *everything* it finds there
into the wheel. A ``build/`` left in a checkout by an older build (one that installed the
top-level packages ``supervisor``, ``agent``, ``shared``, ``cli``) would put those back into a
new wheel, next to ``tether``, and a top-level ``supervisor`` overwrites supervisord's. So every
wheel (and editable wheel) is built from an empty build directory. ``build/`` is only ever
setuptools' scratch space (it is in .gitignore), so nothing of value is removed.
"""

from __future__ import annotations

import os
import shutil
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
    # The backend runs with the project's root as its working directory (PEP 517).
    if os.path.isdir("build") and not os.path.islink("build"):
        shutil.rmtree("build")


def build_wheel(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                metadata_directory: str | None = None) -> str:
    _clean()
    return str(_setuptools.build_wheel(wheel_directory, config_settings, metadata_directory))


def build_editable(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                   metadata_directory: str | None = None) -> str:
    _clean()
    return str(_setuptools.build_editable(wheel_directory, config_settings, metadata_directory))
