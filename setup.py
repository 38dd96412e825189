"""The one compiled part of tether (supervisor/_heapfile.c: supervisor/heapfile.py says why);
everything else is in pyproject.toml. Optional: where it cannot be built (no C compiler),
tether installs and runs without it, and its template says so in supervisors.log."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tether.supervisor._heapfile", ["supervisor/_heapfile.c"],
                             extra_compile_args=["-O2", "-Wall"], optional=True)])
