"""Container steps (``submit --container``): their options, checked, and the OCI runtime
configuration (``config.json``) tether writes for each task. Pure.

The request's ``container`` argument, as the command line sends it (every field checked again
by the agent: every local user is hostile)::

    {"rootfs": "/abs/path",              the root filesystem (a bundle's rootfs/, or the dir)
     "env": ["PATH=/usr/bin", ...],      the bundle's config.json process.env, read by the CLI
                                         as the user (the agent and supervisor never open it)
     "mounts": [["/src", "/dst", true]], --container-mounts: source, destination, read-only
     "runtime": "crun",                  --container-runtime, or absent: the site's default
     "remap_root": false}                --container-remap-root: the user is root inside

The configuration is tether's own, never the user's: the user's config.json could ask for
anything (devices, hooks, capabilities); tether takes only its environment. It runs the task
as the user, in a user namespace that maps the user's uid and gid to themselves and nothing
else, with no capabilities and no new privileges; the host's /proc, /dev, /sys and /tmp, the
user's home and the working directory are bind-mounted at their own paths, then the
``--container-mounts``. No PID, network or IPC namespace: the container's processes are
ordinary processes of the step (its cgroup, its signals, ``inspect --pids``), and MPI ranks
in different containers share memory and the network as they do outside.
"""

from __future__ import annotations

import os
from typing import Any

#: a run directory's subdirectory of container configurations and runtime state
#: (supervisor/container.py; removed with the run directory, and by the agent's fallback)
OCI_DIR = "oci"
#: the OCI runtimes tether knows how to drive (supervisor/container.py)
RUNTIMES = ("crun", "runc")
DEFAULT_RUNTIME = "crun"
MAX_MOUNTS = 64
MAX_PATH = 4096
#: the image's variables kept (a bundle's config.json), and their size in all
MAX_IMAGE_ENV = 512
MAX_IMAGE_ENV_BYTES = 128 << 10
#: the variables an image decides (when it sets them) over the submitter's: the host's PATH
#: and libraries mean nothing inside another distribution (Apptainer does the same)
IMAGE_WINS = ("PATH", "LD_LIBRARY_PATH")
#: set unless the job sets them: each rank's container is a user namespace of its own, where
#: another rank's /proc/PID/fd (UCX's default way to share memory) is refused; UCX then
#: shares it through named files in /dev/shm, which every container mounts
DEFAULTS = {"UCX_POSIX_USE_PROC_LINK": "n"}
#: what the supervisor adds for the host's tools and that names host files the container
#: does not see (the node's hwloc XML: agent/topology.py)
HOST_ONLY = ("HWLOC_XMLFILE", "HWLOC_THISSYSTEM", "HWLOC_THISSYSTEM_ALLOWED_RESOURCES")


def _abs_path(text: Any, what: str) -> str:
    if not isinstance(text, str) or not text:
        raise ValueError(f"{what} must be a path")
    if "\0" in text or len(text) > MAX_PATH:
        raise ValueError(f"{what} {text[:80]!r} is not a usable path")
    if not text.startswith("/"):
        raise ValueError(f"{what} {text!r} must be an absolute path")
    return os.path.normpath(text)


def parse_mounts(text: str) -> list[tuple[str, str, bool]]:
    """``--container-mounts SRC[:DST][:ro|rw],...`` (pyxis's spelling): (source, destination,
    read-only) for each, in order; DST defaults to SRC. Both absolute."""
    out: list[tuple[str, str, bool]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        fields = part.split(":")
        ro = False
        if len(fields) > 1 and fields[-1] in ("ro", "rw"):
            ro = fields.pop() == "ro"
        if len(fields) == 1:
            fields.append(fields[0])
        if len(fields) != 2:
            raise ValueError(f"container mount {part!r} is not SRC[:DST][:ro|rw]")
        src = _abs_path(fields[0], "container mount source")
        dst = _abs_path(fields[1], "container mount destination")
        if dst == "/":
            raise ValueError(f"container mount {part!r}: the destination cannot be /")
        out.append((src, dst, ro))
    if len(out) > MAX_MOUNTS:
        raise ValueError(f"more than {MAX_MOUNTS} container mounts")
    return out


def check_request(value: Any) -> dict[str, Any]:
    """The ``container`` argument of a submission, checked and normalised (ValueError names
    what is wrong)."""
    if not isinstance(value, dict):
        raise ValueError("'container' must be a map")
    unknown = set(value) - {"rootfs", "env", "mounts", "runtime", "remap_root"}
    if unknown:
        raise ValueError(f"'container' has unknown field(s) {', '.join(sorted(unknown))}")
    rootfs = _abs_path(value.get("rootfs"), "the container's root filesystem")
    if rootfs == "/":
        raise ValueError("the container's root filesystem cannot be /")
    env = value.get("env", [])
    if not isinstance(env, list) or len(env) > MAX_IMAGE_ENV or not all(
            isinstance(e, str) and "=" in e and "\0" not in e and not e.startswith("=")
            for e in env):
        raise ValueError(f"the container's environment must be a list of at most "
                         f"{MAX_IMAGE_ENV} NAME=VALUE strings")
    if sum(len(e) for e in env) > MAX_IMAGE_ENV_BYTES:
        raise ValueError("the container's environment is too large")
    mounts = value.get("mounts", [])
    if not isinstance(mounts, list) or len(mounts) > MAX_MOUNTS:
        raise ValueError(f"'mounts' must be a list of at most {MAX_MOUNTS} mounts")
    checked = []
    for m in mounts:
        if not (isinstance(m, list) and len(m) == 3 and isinstance(m[2], bool)):
            raise ValueError("each container mount must be [source, destination, read-only]")
        src = _abs_path(m[0], "container mount source")
        dst = _abs_path(m[1], "container mount destination")
        if dst == "/":
            raise ValueError("a container mount's destination cannot be /")
        checked.append([src, dst, m[2]])
    out: dict[str, Any] = {"rootfs": rootfs, "env": list(env), "mounts": checked}
    runtime = value.get("runtime")
    if runtime is not None:
        if runtime not in RUNTIMES:
            raise ValueError(f"unknown container runtime {runtime!r}: use one of "
                             f"{', '.join(RUNTIMES)}")
        out["runtime"] = runtime
    remap = value.get("remap_root", False)
    if not isinstance(remap, bool):
        raise ValueError("'remap_root' must be true or false")
    if remap:
        out["remap_root"] = True
    return out


def needs_root_inside(runtime: str, remap_root: bool) -> bool:
    """Does the task run as root inside its user namespace? When asked (pyxis's
    ``--container-remap-root``), and always with runc, which insists on a mapping of the
    container's root (and an unprivileged user may map her own uid only, once)."""
    return remap_root or runtime == "runc"


def image_env(config: Any) -> list[str]:
    """The environment a bundle's config.json gives its process (``process.env``), [] when it
    gives none; ValueError when the file is not an OCI configuration."""
    if not isinstance(config, dict):
        raise ValueError("not a JSON object")
    process = config.get("process", {})
    env = process.get("env", []) if isinstance(process, dict) else None
    if not isinstance(env, list) or not all(isinstance(e, str) and "=" in e for e in env):
        raise ValueError("its process.env is not a list of NAME=VALUE strings")
    return [e for e in env if not e.startswith("=") and "\0" not in e][:MAX_IMAGE_ENV]


def merged_env(image: list[str], job: dict[str, str]) -> list[str]:
    """The container's environment: the image's, the job's on top, except ``IMAGE_WINS``
    where the image sets them; never the host-only variables."""
    env: dict[str, str] = {}
    for item in image:
        k, _, v = item.partition("=")
        env[k] = v
    from_image = {k for k in IMAGE_WINS if k in env}
    for k, v in job.items():
        if k not in from_image:
            env[k] = v
    for k in HOST_ONLY:
        env.pop(k, None)
    for k, v in DEFAULTS.items():
        env.setdefault(k, v)
    return [f"{k}={v}" for k, v in env.items()]


def _bind(src: str, dst: str, *extra: str) -> dict[str, Any]:
    return {"destination": dst, "type": "bind", "source": src,
            "options": ["rbind", "nosuid", *extra]}


def config(*, rootfs: str, args: list[str], env: list[str], cwd: str, uid: int, gid: int,
           home: str | None, mounts: list[list[Any]], root_inside: bool = False,
           ) -> dict[str, Any]:
    """The OCI runtime configuration of one task (runtime-spec 1.0). ``root_inside``: the
    user's uid and gid are mapped to 0 inside and the task runs as 0 (still her outside, with
    no capability beyond her own namespaces); else they are mapped to themselves."""
    inside_uid, inside_gid = (0, 0) if root_inside else (uid, gid)
    binds = [_bind("/proc", "/proc"), _bind("/dev", "/dev"),
             _bind("/sys", "/sys", "nodev", "noexec"), _bind("/tmp", "/tmp", "nodev")]
    if home and home != "/" and os.path.isabs(home):
        parent = os.path.dirname(os.path.normpath(home))
        if parent not in ("/", "/tmp"):
            # a fresh tmpfs over the image's /home: the user's home gets a mount point there
            # even in a root filesystem she cannot write, and nobody else's home is seen
            binds.append({"destination": parent, "type": "tmpfs", "source": "tmpfs",
                          "options": ["nosuid", "nodev", "mode=755"]})
        binds.append(_bind(home, os.path.normpath(home), "nodev"))
    binds.append(_bind(cwd, cwd, "nodev"))
    for src, dst, ro in mounts:
        binds.append(_bind(src, dst, "nodev", *(["ro"] if ro else [])))
    no_caps: dict[str, list[str]] = {k: [] for k in
                                     ("bounding", "effective", "inheritable", "permitted",
                                      "ambient")}
    return {
        "ociVersion": "1.0.2",
        "process": {"terminal": False, "user": {"uid": inside_uid, "gid": inside_gid},
                    "args": list(args),
                    "env": list(env), "cwd": cwd, "noNewPrivileges": True,
                    "capabilities": no_caps},
        "root": {"path": rootfs, "readonly": True},
        "mounts": binds,
        "linux": {"namespaces": [{"type": "user"}, {"type": "mount"}],
                  "uidMappings": [{"containerID": inside_uid, "hostID": uid, "size": 1}],
                  "gidMappings": [{"containerID": inside_gid, "hostID": gid, "size": 1}]},
    }
