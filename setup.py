"""The files installed under share/, and where a build works; everything else is in
pyproject.toml. tether is pure Python: nothing is compiled.

Under the installation's prefix (``/usr/local`` for a system pip, the venv's own directory):
``share/doc/tether`` (README, LICENSE, docs/), ``share/tether/systemd`` (the unit and the slice,
to copy to /etc/systemd/system: docs/operations.md), ``share/man/man1/tether.1`` and the
completions where bash-completion and zsh look (the man page and the completions are written
from the parser by scripts/doc_tables.py; tests/unit/test_doc_tables.py keeps them in step).

``TETHER_BUILD_BASE`` (set by scripts/tether_build.py for every wheel) moves setuptools'
scratch space out of the checkout: a checkout's ``build/`` holds the links of its editable
install (scripts/setup.sh), which building a wheel there used to delete.
"""

import glob
import os

from setuptools import setup

DATA_FILES = [
    ("share/doc/tether", ["README.md", "LICENSE", *sorted(glob.glob("docs/*.md"))]),
    ("share/tether/systemd", ["contrib/systemd/tether-agent.service",
                              "contrib/systemd/tether.slice"]),
    ("share/man/man1", ["contrib/man/tether.1"]),
    ("share/bash-completion/completions", ["contrib/completion/bash/tether"]),
    ("share/zsh/site-functions", ["contrib/completion/zsh/_tether"]),
]

options = {}
base = os.environ.get("TETHER_BUILD_BASE")
if base:
    options = {"build": {"build_base": os.path.join(base, "build")},
               "egg_info": {"egg_base": base}}

setup(data_files=DATA_FILES, options=options)
