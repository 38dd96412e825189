"""The one compiled part of tether (supervisor/_heapfile.c: supervisor/heapfile.py says why);
everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tether.supervisor._heapfile", ["supervisor/_heapfile.c"],
                             extra_compile_args=["-O2", "-Wall", "-Werror"])])
