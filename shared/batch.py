"""Batch scripts (``tether submit job.sh [ARG...]``), the parts every side agrees on. Pure.

The command line reads the script as its user and sends its bytes with the submission; the
agent keeps them (at most ``MAX_SCRIPT``: they travel in one request, whose frame is at most
1 MiB with the environment); at launch the supervisor hands the copy to each task on a file
descriptor and the task runs ``INTERPRETER [ARG] /proc/self/fd/N ARG...``: the script's own
``#!`` line read as the kernel reads it (the interpreter, and the rest of the line as one
argument), or ``/bin/sh`` for a script without one. The copy is what runs, whatever becomes of
the file, and it runs that way whether or not the file was executable.
"""

from __future__ import annotations

#: the largest script a submission carries
MAX_SCRIPT = 512 * 1024
#: what runs a script without a ``#!`` line (sbatch refuses one; a shell script is the rule)
DEFAULT_SHELL = "/bin/sh"
#: the kernel's limit on a ``#!`` line (BINPRM_BUF_SIZE)
SHEBANG_MAX = 256


def interpreter(script: bytes) -> list[str]:
    """The interpreter and its one optional argument, from the ``#!`` line as Linux reads it:
    the path up to the first blank, the rest of the line (blanks around it dropped) as a
    single argument. ``[DEFAULT_SHELL]`` without a ``#!`` line or a path in it."""
    if not script.startswith(b"#!"):
        return [DEFAULT_SHELL]
    line = script[2:SHEBANG_MAX].split(b"\n", 1)[0].strip(b" \t")
    path, _, arg = line.replace(b"\t", b" ").partition(b" ")
    if not path:
        return [DEFAULT_SHELL]
    words = [path, arg.strip(b" ")] if arg.strip(b" ") else [path]
    return [w.decode("utf-8", "surrogateescape") for w in words]


def looks_binary(head: bytes) -> bool:
    """Is a file that begins with ``head`` a program rather than a script: an ELF executable,
    or anything with a NUL byte before its first line ends (``submit FILE`` runs those as
    commands, as with ``--``)."""
    if head.startswith(b"#!"):
        return False
    return head.startswith(b"\x7fELF") or b"\0" in head.split(b"\n", 1)[0] or b"\0" in head[:1024]
