"""Write the venv's ``tether`` command: ``.venv/bin/python scripts/launcher.py .venv/bin/tether``
(setup.sh runs it after pip has installed the package).

pip's console script starts the interpreter with ``site``: the venv's site-packages and the
``.pth`` files in it, and on Debian ``sitecustomize``, which imports apport's crash hook. That
is ~2 ms of every command's ~12 before tether's own first line runs (docs/cli.md, "Start-up"),
and its teardown more at exit. The command written here starts ``python -IS`` instead:

- ``-S``: no ``site``. The directories ``site`` would have added (site-packages, and the
  folder the strict editable install's ``.pth`` names) are computed now, by asking this very
  interpreter with and without ``site``, and appended by the script itself, in ``site``'s order.
  They are fixed paths inside the venv: ``site`` would find the same ones at every start.
- ``-I``: isolated, as the supervisors and the template already run. ``PYTHON*`` variables,
  the user's site directory and the current directory no longer reach the command: the agent
  (``tether agent``, root) imports nothing through a path a user sets.

Anything else ``site`` does is not needed by a command line: ``exit``/``quit`` and ``help`` for
the interactive prompt, the venv's ``sys.prefix`` (tether reads none of it: the supervisors
are started with ``sys.executable``, which names the venv's interpreter either way).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

BODY = '''#!{python} -IS
# tether's command line, written by scripts/launcher.py: started without `site` (its
# directories are listed below, as it would have found them), isolated from PYTHON* variables.
import sys
sys.path += {extra!r}
from tether.cli.main import entry
if __name__ == "__main__":
    sys.exit(entry())
'''


def site_dirs(python: str) -> list[str]:
    """What ``site`` adds to ``sys.path`` for ``python -I``, in its order."""
    probe = "import json, sys; print(json.dumps(sys.path))"
    with_site = json.loads(subprocess.run([python, "-I", "-c", probe], check=True,
                                          capture_output=True, text=True).stdout)
    without = set(json.loads(subprocess.run([python, "-I", "-S", "-c", probe], check=True,
                                            capture_output=True, text=True).stdout))
    return [p for p in with_site if p not in without]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/launcher.py PATH-OF-THE-COMMAND", file=sys.stderr)
        return 2
    target = argv[0]
    # the venv's own interpreter path (the link), not what it resolves to: site finds the venv
    # through it, and the script's first line names it
    python = os.path.abspath(sys.executable)
    extra = site_dirs(python)
    if not any(os.path.isdir(os.path.join(d, "tether")) for d in extra):
        print(f"launcher: tether is not importable from {extra} (is it installed in "
              f"{python}'s environment?)", file=sys.stderr)
        return 1
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(BODY.format(python=python, extra=extra))
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
