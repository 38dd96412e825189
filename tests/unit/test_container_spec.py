"""The container options and the runtime configuration tether writes (shared/container_spec.py,
pure; the agent's own check of a hostile argument: tests/integration/test_containers.py)."""

from __future__ import annotations

import pytest

from tether.shared import container_spec as cs


def test_mounts_in_pyxiss_spelling() -> None:
    assert cs.parse_mounts("/a,/b:/c:ro, /d:/e:rw,/f:ro") == [
        ("/a", "/a", False), ("/b", "/c", True), ("/d", "/e", False), ("/f", "/f", True)]
    for bad in ("rel:/x", "/x:rel", "/a:/b:/c", "/a:/", "/a\0b"):
        with pytest.raises(ValueError):
            cs.parse_mounts(bad)


def test_a_request_is_checked_field_by_field() -> None:
    good = {"rootfs": "/srv/img/rootfs", "env": ["PATH=/bin"], "mounts": [["/a", "/b", True]]}
    assert cs.check_request(good) == good
    assert cs.check_request({**good, "runtime": "runc", "remap_root": True})["runtime"] == "runc"
    for bad in ({**good, "rootfs": "rel"}, {**good, "rootfs": "/"}, {**good, "rootfs": 3},
                {**good, "env": ["NOEQUALS"]}, {**good, "env": "PATH=/bin"},
                {**good, "mounts": [["/a", "/b"]]}, {**good, "mounts": [["/a", "/", False]]},
                {**good, "runtime": "docker"}, {**good, "remap_root": 1},
                {**good, "hooks": {}}, ["not", "a", "map"]):
        with pytest.raises(ValueError):
            cs.check_request(bad)


def test_the_configuration_is_the_users_own_and_unprivileged() -> None:
    cfg = cs.config(rootfs="/r", args=["prog"], env=["A=1"], cwd="/home/u/w", uid=1001,
                    gid=1002, home="/home/u", mounts=[["/data", "/in", True]])
    proc = cfg["process"]
    assert proc["user"] == {"uid": 1001, "gid": 1002} and proc["noNewPrivileges"] is True
    assert all(caps == [] for caps in proc["capabilities"].values())
    assert cfg["linux"]["uidMappings"] == [{"containerID": 1001, "hostID": 1001, "size": 1}]
    assert cfg["linux"]["gidMappings"] == [{"containerID": 1002, "hostID": 1002, "size": 1}]
    assert {n["type"] for n in cfg["linux"]["namespaces"]} == {"user", "mount"}
    assert cfg["root"] == {"path": "/r", "readonly": True}
    dests = [m["destination"] for m in cfg["mounts"]]
    assert dests == ["/proc", "/dev", "/sys", "/tmp", "/home", "/home/u", "/home/u/w", "/in"]
    assert "ro" in cfg["mounts"][-1]["options"]
    assert all("nosuid" in m["options"] for m in cfg["mounts"])
    root = cs.config(rootfs="/r", args=["p"], env=[], cwd="/w", uid=1001, gid=1002, home=None,
                     mounts=[], root_inside=True)
    assert root["process"]["user"] == {"uid": 0, "gid": 0}
    assert root["linux"]["uidMappings"] == [{"containerID": 0, "hostID": 1001, "size": 1}]


def test_the_images_path_wins_and_host_only_variables_stay_out() -> None:
    env = cs.merged_env(["PATH=/opt/bin", "FOO=image", "LANG=C"],
                        {"PATH": "/usr/bin", "FOO": "job", "HWLOC_XMLFILE": "/x",
                         "TETHER_JOB_ID": "7"})
    assert env == ["PATH=/opt/bin", "FOO=job", "LANG=C", "TETHER_JOB_ID=7",
                   "UCX_POSIX_USE_PROC_LINK=n"]
    assert "UCX_POSIX_USE_PROC_LINK=y" in cs.merged_env([], {"UCX_POSIX_USE_PROC_LINK": "y"})
