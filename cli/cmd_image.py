"""``tether image import NAME FILE.tar`` and ``tether image list``: the node's container images,
each an OCI bundle under ``<state dir>/images/NAME/`` (``config.json`` and ``rootfs/``), which
``submit --container NAME`` runs.

An OCI image archive (a tar of an OCI image layout: ``oci-layout``, ``index.json``,
``blobs/``) is unpacked by the maintained tools, skopeo (the archive to a layout) and umoci (the
layout's image to a bundle: its layers in order, whiteouts and all, and its configuration's
environment in config.json). A plain root filesystem tarball becomes the one layer of a new
image (umoci), unpacked the same way: umoci is made for untrusted layers (no name out of the
tree, no write through a link). Either is unpacked beside the images under a temporary name
and renamed into place, so a half-unpacked image is never listed or run.

The images belong to whoever owns the state directory (root, for the node's agent): every
user may run them, which is why they are imported by that owner only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile  # only to tell the two kinds apart (reads the names)
import tempfile
import time
from typing import Any

from tether.cli.errors import EXIT_USAGE, CliError

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse

    from tether.shared.paths import Layout

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: written beside config.json: where the image came from
META = "tether-image.json"
TOOL_TIMEOUT = 600


def images_dir(state_dir: str) -> str:
    return os.path.join(state_dir, "images")


def resolve(state_dir: str, name: str) -> str | None:
    """The bundle of image ``name`` (``submit --container NAME``), or None."""
    if not NAME.fullmatch(name):
        return None
    path = os.path.join(images_dir(state_dir), name)
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def image(layout: Layout, ns: argparse.Namespace) -> int:
    if ns.image_cmd == "import":
        return import_image(layout, ns.name, ns.file)
    return list_images(layout, ns.json)


def import_image(layout: Layout, name: str, archive: str) -> int:
    if not NAME.fullmatch(name):
        raise CliError(f"image import: {name!r} is not an image name (letters, digits, '.', "
                       "'_', '-'; up to 64)", EXIT_USAGE)
    if not os.path.isfile(archive):
        raise CliError(f"image import: {archive}: no such file", EXIT_USAGE)
    top = images_dir(layout.state_dir)
    try:
        os.makedirs(top, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise CliError(f"image import: cannot create {top}: {exc.strerror} (images are the "
                       "state directory owner's: root's, for the node's agent)") from None
    dest = os.path.join(top, name)
    if os.path.lexists(dest):
        raise CliError(f"image import: image {name} exists ({dest}); remove it first")
    work = tempfile.mkdtemp(dir=top, prefix=f".{name}.")
    os.chmod(work, 0o755)
    try:
        bundle = os.path.join(work, "bundle")
        kind = _kind(archive)
        if kind == "oci":
            _unpack_oci(archive, work, bundle)
        else:
            _unpack_rootfs(archive, work, bundle)
        with open(os.path.join(bundle, META), "w") as f:
            json.dump({"name": name, "kind": kind, "source": os.path.abspath(archive),
                       "imported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f)
        os.chmod(bundle, 0o755)
        os.rename(bundle, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(dest)
    return 0


def _kind(archive: str) -> str:
    """``oci`` for an OCI image layout's archive, else ``rootfs``."""
    try:
        with tarfile.open(archive) as tar:
            for member in tar:
                if member.name.lstrip("./") == "oci-layout":
                    return "oci"
    except (tarfile.TarError, OSError) as exc:
        raise CliError(f"image import: {archive}: not a tar archive ({exc})") from None
    return "rootfs"


def _run(argv: list[str]) -> None:
    tool = shutil.which(argv[0])
    if tool is None:
        raise CliError(f"image import: {argv[0]} is not installed (scripts/setup.sh --tests "
                       "installs skopeo and umoci)")
    try:
        res = subprocess.run([tool, *argv[1:]], capture_output=True, text=True,
                             timeout=TOOL_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise CliError(f"image import: {argv[0]} took over {TOOL_TIMEOUT}s") from None
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no message"])[-1]
        raise CliError(f"image import: {argv[0]} failed: {last}")


def _unpack_oci(archive: str, work: str, bundle: str) -> None:
    layout = os.path.join(work, "layout")
    _run(["skopeo", "copy", "--quiet", f"oci-archive:{os.path.abspath(archive)}",
          f"oci:{layout}:tether"])
    _unpack(layout, bundle)


def _unpack_rootfs(archive: str, work: str, bundle: str) -> None:
    """A root filesystem tarball made the one layer of an image, which umoci unpacks as it
    unpacks any image's layers (no name out of the tree, no write through a link)."""
    layout = os.path.join(work, "layout")
    _run(["umoci", "init", "--layout", layout])
    _run(["umoci", "new", "--image", f"{layout}:tether"])
    _run(["umoci", "raw", "add-layer", "--image", f"{layout}:tether", os.path.abspath(archive)])
    _unpack(layout, bundle)
    rootfs = os.path.join(bundle, "rootfs")
    if not any(os.path.isdir(os.path.join(rootfs, d)) for d in ("bin", "usr")):
        raise CliError(f"image import: {archive} has neither bin/ nor usr/ at its top: not a "
                       "root filesystem")


def _unpack(layout: str, bundle: str) -> None:
    unpack = ["umoci", "unpack"]
    if os.geteuid() != 0:
        unpack.append("--rootless")
    _run([*unpack, "--image", f"{layout}:tether", bundle])


def list_images(layout: Layout, as_json: bool) -> int:
    top = images_dir(layout.state_dir)
    try:
        names = sorted(n for n in os.listdir(top) if NAME.fullmatch(n))
    except FileNotFoundError:
        names = []
    rows: list[dict[str, Any]] = []
    for n in names:
        meta: dict[str, Any] = {}
        try:
            with open(os.path.join(top, n, META)) as f:
                loaded = json.load(f)
            if isinstance(loaded, dict):
                meta = loaded
        except (OSError, ValueError):
            pass
        rows.append({"name": n, "path": os.path.join(top, n), "kind": meta.get("kind"),
                     "imported_at": meta.get("imported_at"), "source": meta.get("source")})
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    from tether.shared.text import printable

    print(f"{'NAME':<24} {'KIND':<7} {'IMPORTED':<25} SOURCE")
    for r in rows:
        print(printable(f"{r['name']:<24} {r['kind'] or '?':<7} {r['imported_at'] or '?':<25} "
                        f"{r['source'] or '?'}"))
    return 0
