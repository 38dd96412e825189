"""``submit --container PATH``: the root filesystem and the image's environment, read here as
the submitting user (the agent and the supervisor never open her paths), and the mounts.

PATH is an OCI bundle (a directory with ``config.json`` and ``rootfs/``: its rootfs and its
config's ``process.env`` are taken, nothing else of it) or a root filesystem directory.
"""

from __future__ import annotations

import os
from typing import Any

from tether.cli.errors import EXIT_USAGE, CliError
from tether.shared import container_spec

#: the most of a bundle's config.json read
MAX_CONFIG = 1 << 20


def container_arg(path: str, mounts: str | None, runtime: str | None,
                  remap_root: bool = False) -> dict[str, Any]:
    """The submission's ``container`` argument (shared/container_spec.py); CliError names
    what is wrong with the path or a mount."""
    import json

    top = os.path.abspath(path)
    if not os.path.isdir(top):
        raise CliError(f"submit: --container {path}: not a directory (an OCI bundle or a root "
                       "filesystem)", EXIT_USAGE)
    env: list[str] = []
    rootfs = top
    config = os.path.join(top, "config.json")
    if os.path.isdir(os.path.join(top, "rootfs")) and os.path.lexists(config):
        rootfs = os.path.join(top, "rootfs")
        try:
            with open(config, "rb") as f:
                data = f.read(MAX_CONFIG + 1)
            if len(data) > MAX_CONFIG:
                raise ValueError(f"larger than {MAX_CONFIG} bytes")
            env = container_spec.image_env(json.loads(data))
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise CliError(f"submit: --container {path}: {config}: {why}", EXIT_USAGE) from None
    if not os.path.isdir(os.path.join(rootfs, "bin")) and not os.path.isdir(
            os.path.join(rootfs, "usr")):
        raise CliError(f"submit: --container {path}: {rootfs} has neither bin/ nor usr/: not "
                       "a root filesystem", EXIT_USAGE)
    value: dict[str, Any] = {"rootfs": os.path.realpath(rootfs), "env": env, "mounts": []}
    try:
        for src, dst, ro in container_spec.parse_mounts(mounts or ""):
            if not os.path.exists(src):
                raise ValueError(f"container mount source {src} does not exist")
            value["mounts"].append([src, dst, ro])
        if runtime is not None:
            value["runtime"] = runtime
        if remap_root:
            value["remap_root"] = True
        return container_spec.check_request(value)
    except ValueError as exc:
        raise CliError(f"submit: {exc}", EXIT_USAGE) from None
