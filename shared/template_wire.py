"""What the agent and the warm supervisor template say to each other (see supervisor/template.py).

One connection per request on the template's ``SOCK_SEQPACKET`` socket, one msgpack map each way:

    {"op": "hello"}                          -> {"ok": true, "identity": str, "pid": int}
        optional "agent_lock": str, "linger": float: leave once no agent held that lock for
        that long (a template started before these ignores them)
    {"op": "exit", "identity": str}          -> {"ok": true}, and the template leaves
    {"op": "stop"}                           -> {"ok": true}, and the template leaves (its agent
                                                stopped for good); older ones: refused
    {"op": "spawn", "run_dir": str, "env": {str: str}, "umask": int}
        with SCM_RIGHTS [lock fd, log fd, ready fd] -> {"ok": true, "pid": int}
    anything refused                         -> {"ok": false, "error": str}

``identity`` names the code a template runs: the release plus the size and mtime of every source
file a supervisor loads. The agent compares it with the files on disk and replaces a template
that runs other code than what is installed now; an unchanged template outlives agent restarts.
"""

from __future__ import annotations

import os

try:
    # the interpreter's own SHA-1, not hashlib's: that maps OpenSSL's libcrypto into the
    # template (and so into every supervisor it forks: mappings each fork copies, each exit
    # tears down)
    from _sha1 import sha1
except ImportError:  # a Python built without its own hashes (--with-builtin-hashlib-hashes)
    from hashlib import sha1

import msgpack

import tether

#: Largest request or reply; a spawn request carries the job's environment.
MAX_MESSAGE = 1 << 20
#: The fds a spawn request carries, in this order.
SPAWN_FDS = 3

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class TemplateError(Exception):
    pass


def code_identity() -> str:
    """The release and a digest of the supervisor's source files as they are on disk now."""
    root = os.path.dirname(os.path.abspath(tether.__file__))
    digest = sha1(usedforsecurity=False)
    for sub in ("", "shared", "supervisor"):
        folder = os.path.join(root, sub)
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            if name.endswith(".py"):
                try:
                    st = os.stat(os.path.join(folder, name))
                except OSError:
                    continue
                digest.update(f"{sub}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return f"{tether.__version__}+{digest.hexdigest()[:16]}"


def template_identity(ksm: bool) -> str:
    """What names a template: its code and its settings (``agent --ksm``), so that an agent
    started with other settings replaces it as it would one running other code."""
    return code_identity() + ("+ksm" if ksm else "")


def encode(obj: dict[str, Any]) -> bytes:
    data: bytes = msgpack.packb(obj)
    if len(data) > MAX_MESSAGE:
        raise TemplateError(f"template message of {len(data)} bytes is over {MAX_MESSAGE}")
    return data


def decode(data: bytes) -> dict[str, Any]:
    """A map, or ``TemplateError`` naming what is wrong with the bytes."""
    if not data:
        raise TemplateError("connection closed without a message")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types for bad input
        raise TemplateError(f"undecodable template message ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise TemplateError("template message is not a map")
    return obj


def spawn_request(run_dir: str, env: dict[str, str], umask: int) -> bytes:
    return encode({"op": "spawn", "run_dir": run_dir, "env": env, "umask": umask})


def check_spawn(req: dict[str, Any]) -> tuple[str, dict[str, str], int]:
    """(run dir, environment, umask) of a spawn request, or ``TemplateError``."""
    run_dir, env, umask = req.get("run_dir"), req.get("env"), req.get("umask")
    if not isinstance(run_dir, str) or not os.path.isabs(run_dir) or "\0" in run_dir:
        raise TemplateError("spawn needs an absolute 'run_dir'")
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and "\0" not in k + v and "=" not in k
            and k for k, v in env.items()):
        raise TemplateError("spawn needs 'env', a map of strings")
    if not isinstance(umask, int) or isinstance(umask, bool) or not 0 <= umask <= 0o777:
        raise TemplateError("spawn needs 'umask', an integer 0..0o777")
    return run_dir, env, umask
