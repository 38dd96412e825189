"""Container steps (``submit --container``, issue 31): a real OCI runtime (crun) runs each task
in a root filesystem made of Debian's busybox-static, as a real test user, inside the step's
cgroup."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.helpers import Node, pid_alive, poll_until
from tests.userkit import User, cli_as, home_for, made_users, ok_as, run_as, shared

BUSYBOX = "/bin/busybox"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")


def need(tool: str, package: str) -> None:
    """What scripts/setup.sh --tests installs: missing, the test fails (a skip would pass a
    run that checked nothing)."""
    if shutil.which(tool) is None:
        pytest.fail(f"{tool} is missing: install Debian's {package} (scripts/setup.sh --tests "
                    "does)", pytrace=False)

APPLETS = ("sh", "id", "cat", "sleep", "echo", "env", "true", "ls", "pwd", "head", "tr",
           "test", "kill", "touch")


@pytest.fixture
def alice() -> Iterator[User]:
    with made_users(1) as users:
        yield users[0]


def make_rootfs(top: str) -> str:
    """A root filesystem of one static busybox (root's, read-only to everyone else)."""
    os.makedirs(top)
    for d in ("bin", "etc", "proc", "dev", "sys", "tmp", "home"):
        os.mkdir(os.path.join(top, d))
    shutil.copy(BUSYBOX, os.path.join(top, "bin", "busybox"))
    for applet in APPLETS:
        os.symlink("busybox", os.path.join(top, "bin", applet))
    with open(os.path.join(top, "etc", "marker"), "w") as f:
        f.write("inside\n")
    return top


@pytest.fixture
def rootfs(node: Node) -> str:
    need("crun", "crun")
    if not os.path.exists(BUSYBOX):
        pytest.fail("busybox is missing: install Debian's busybox-static (scripts/setup.sh "
                    "--tests does)", pytrace=False)
    shared(node)
    return make_rootfs(os.path.join(node.dir, "rootfs"))


def submit_as(user: User, node: Node, work: str, *args: str) -> int:
    return int(ok_as(user, node, "submit", *args, cwd=work).strip())


def output(node: Node, job: int) -> str:
    with open(node.job(job)["output"]) as f:
        return f.read()


def oci_dir(node: Node, job: int) -> str:
    return os.path.join(node.state, "run", f"{job}.1", "oci")


def wait_gone(path: str, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_container_job_runs_as_its_user_in_its_root_filesystem(node: Node, rootfs: str,
                                                                 alice: User) -> None:
    work = home_for(node, alice)
    node.start()
    script = ("id -u; id -g; pwd; cat /etc/marker; echo job=$TETHER_JOB_ID "
              "tasks=$TETHER_NTASKS; test -e /etc/shadow && echo shadow || echo no-shadow; "
              "touch here; cat /proc/self/cgroup")
    job = submit_as(alice, node, work, "--container", rootfs, "--", "sh", "-c", script)
    end = node.wait_end(job)
    assert (end["state"], end["exit_code"]) == ("completed", 0), (end, output(node, job))
    lines = output(node, job).splitlines()
    assert lines[:6] == [str(alice.uid), str(alice.gid), work, "inside", f"job={job} tasks=1",
                         "no-shadow"], lines
    # the working directory is the user's own, mounted: what the job wrote is there
    assert os.stat(os.path.join(work, "here")).st_uid == alice.uid
    # every process inside stayed in the step's cgroup (not the runtime's own)
    assert any("tether-" in ln for ln in lines[6:] if ":memory:" in ln), lines
    assert wait_gone(oci_dir(node, job)), os.listdir(oci_dir(node, job))


def test_exit_code_and_signal_are_the_container_processs(node: Node, rootfs: str,
                                                         alice: User) -> None:
    work = home_for(node, alice)
    node.start()
    coded = submit_as(alice, node, work, "--container", rootfs, "--", "sh", "-c", "exit 7")
    killed = submit_as(alice, node, work, "--container", rootfs, "--", "sh", "-c",
                       "kill -TERM $$")
    end = node.wait_end(coded)
    assert (end["state"], end["exit_code"], end["signal"]) == ("failed", 7, None), end
    end = node.wait_end(killed)
    assert (end["state"], end["signal"]) == ("failed", signal.SIGTERM), end
    assert "SIGTERM" in end["reason"], end


def test_a_container_that_cannot_start_fails_with_the_runtimes_reason(node: Node, rootfs: str,
                                                                      alice: User) -> None:
    work = home_for(node, alice)
    node.start()
    job = submit_as(alice, node, work, "--container", rootfs, "--", "/bin/no-such-program")
    end = node.wait_end(job)
    assert end["state"] == "failed", end
    assert "container runtime crun" in end["reason"] and "no-such-program" in end["reason"], end
    # a root filesystem gone by the time the job starts: the runtime's own words
    gone = make_rootfs(os.path.join(node.dir, "gone"))
    held = submit_as(alice, node, work, "--hold", "--container", gone, "--", "true")
    shutil.rmtree(gone)
    ok_as(alice, node, "release", str(held))
    end = node.wait_end(held)
    assert end["state"] == "failed" and end["reason"].startswith("container runtime crun: "), end
    assert gone in end["reason"], end
    # a bundle whose config.json is not JSON
    broken = os.path.join(node.dir, "broken")
    os.mkdir(broken)
    os.symlink(rootfs, os.path.join(broken, "rootfs"))
    with open(os.path.join(broken, "config.json"), "w") as f:
        f.write("{not json")
    res = cli_as(alice, node, "submit", "--container", broken, "--", "true", cwd=work)
    assert res.returncode == 2 and "config.json" in res.stderr, res
    assert len(res.stderr.strip().splitlines()) == 1, res
    # a path that is no root filesystem, or a bad mount: one line at submit, nothing queued
    for bad in (["--container", os.path.join(node.dir, "nowhere")],
                ["--container", work],
                ["--container", rootfs, "--container-mounts", "relative:/x"],
                ["--container-mounts", "/tmp:/x"]):
        res = cli_as(alice, node, "submit", *bad, "--", "true", cwd=work)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, (bad, res)


def test_cancel_kills_everything_inside_and_removes_the_runtime_state(node: Node, rootfs: str,
                                                                      alice: User) -> None:
    work = home_for(node, alice)
    node.start()
    job = submit_as(alice, node, work, "--container", rootfs, "--", "sh", "-c",
                    "trap '' TERM; sleep 1000 & sleep 1000 & echo started; wait")
    node.wait_state(job, ("running",))
    deadline = time.monotonic() + 20
    while "started" not in output(node, job):
        assert time.monotonic() < deadline, node.logs()
        time.sleep(0.05)
    pids = json.loads(ok_as(alice, node, "inspect", str(job), "--pids", "--json"))
    # the container's processes are the task's (children of the runtime, the task's leader)
    inside = [p for p in pids["processes"] if p["comm"] in ("sh", "sleep")]
    assert sorted(p["comm"] for p in inside) == ["sh", "sleep", "sleep"], pids
    assert all(p["rank"] == 0 for p in inside), pids
    assert os.path.isdir(oci_dir(node, job))
    ok_as(alice, node, "cancel", str(job))
    end = node.wait_end(job)
    assert end["state"] == "cancelled", end
    listed = [p["pid"] for p in pids.get("processes", [])] + [
        t["pid"] for t in pids.get("tasks", [])]
    assert listed, pids
    assert not [p for p in listed if pid_alive(p)], pids
    assert wait_gone(oci_dir(node, job))


def test_the_memory_limit_holds_inside(node: Node, rootfs: str, alice: User) -> None:
    work = home_for(node, alice)
    node.start()
    job = submit_as(alice, node, work, "--memory-mb", "64", "--container", rootfs, "--",
                    "sh", "-c", "x=$(head -c 300000000 /dev/zero | tr '\\0' a); echo survived")
    end = node.wait_end(job)
    assert end["state"] == "failed" and end.get("oom"), end
    assert "memory limit of 64 MB" in end["reason"], end
    assert "survived" not in output(node, job)


def test_a_container_step_survives_an_agent_sigkill(node: Node, rootfs: str,
                                                   alice: User) -> None:
    work = home_for(node, alice)
    node.start()
    gate = os.path.join(work, "gate")
    job = submit_as(alice, node, work, "--container", rootfs, "--", "sh", "-c",
                    f"while ! test -e {gate}; do sleep 0.05; done; echo done; exit 3")
    node.wait_state(job, ("running",))
    node.stop(signal.SIGKILL)
    node.start()
    assert node.job(job)["state"] == "running"
    with open(gate, "w"):
        pass
    end = node.wait_end(job)
    assert (end["state"], end["exit_code"]) == ("failed", 3), end
    assert output(node, job).splitlines()[-1] == "done"
    assert wait_gone(oci_dir(node, job))


def test_the_runtime_state_goes_when_the_supervisor_is_killed(node: Node, rootfs: str,
                                                            alice: User) -> None:
    work = home_for(node, alice)
    node.start()
    job = submit_as(alice, node, work, "--container", rootfs, "--", "sleep", "1000")
    node.wait_state(job, ("running",))
    man = node.running_manifest(job)
    state = os.path.join(oci_dir(node, job), "r0", "state")
    poll_until(lambda: os.path.isdir(state) and os.listdir(state), 20, "the runtime's state")
    os.kill(man["supervisor"]["pid"], signal.SIGKILL)
    end = node.wait_end(job)
    assert end["state"] == "lost", end
    assert wait_gone(oci_dir(node, job))
    assert not pid_alive(man["tasks"][0]["pid"])
    # the container's process too (its own session: the step's cgroup found it)
    poll_until(lambda: not processes_of(alice.uid), 20, "the container's processes to go")


def processes_of(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def test_mpich_ranks_in_containers_speak_pmi1(node: Node, rootfs: str, alice: User) -> None:
    """The PMI socket reaches each rank inside its container (moved to fd 3: the runtime's
    --preserve-fds), and MPICH's ranks in two containers find each other."""
    need("mpicc", "libmpich-dev")
    work = home_for(node, alice)
    hello = os.path.join(work, "hello_mpi")
    src = os.path.join(os.path.dirname(os.path.dirname(__file__)), "mpi", "hello_mpi.c")
    subprocess.run(["mpicc", "-O1", "-o", hello, src], check=True)
    os.chmod(hello, 0o755)
    # the host's libraries inside: /usr mounted read-only, /lib and /lib64 as Debian links them
    os.mkdir(os.path.join(rootfs, "usr"))
    for link in ("lib", "lib64"):
        os.symlink(f"usr/{link}", os.path.join(rootfs, link))
    node.start()
    job = submit_as(alice, node, work, "--ntasks", "2", "--pmi", "pmi1", "--container", rootfs,
                    "--container-mounts", "/usr:/usr:ro", "--", hello)
    end = node.wait_end(job)
    assert (end["state"], end["exit_code"]) == ("completed", 0), (end, output(node, job))
    assert sorted(output(node, job).splitlines()) == [
        f"rank {r} of 2 OK (sum 2, from {(r - 1) % 2})" for r in range(2)]


def count_of(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def test_signal_suspend_stats_and_the_time_limit_reach_inside(node: Node, rootfs: str,
                                                              alice: User) -> None:
    work = home_for(node, alice)
    node.start()
    count = os.path.join(work, "count")
    job = submit_as(alice, node, work, "--time", "0:8", "--container", rootfs, "--", "sh", "-c",
                    "trap 'echo got USR1' USR1; i=0; "
                    f"while :; do i=$((i+1)); echo $i > {count}; sleep 0.05; done")
    node.wait_state(job, ("running",))
    poll_until(lambda: count_of(count) > 0, 20, "the container to count")
    # a signal goes to the runtime's process group: the runtime hands it to the container
    ok_as(alice, node, "signal", str(job), "USR1")
    poll_until(lambda: "got USR1" in output(node, job), 20, "the trap to run")
    stats = json.loads(ok_as(alice, node, "inspect", str(job), "--stats", "--json"))
    assert stats, stats
    # suspend freezes the step's cgroup: the container's processes with it
    ok_as(alice, node, "suspend", str(job))
    frozen = count_of(count)
    time.sleep(0.5)  # nothing to poll for: a frozen counter does not move
    assert count_of(count) in (frozen, frozen + 1)
    ok_as(alice, node, "resume", str(job))
    poll_until(lambda: count_of(count) > frozen + 2, 20, "the container to count again")
    end = node.wait_end(job)
    assert end["state"] == "timeout", end
    assert wait_gone(oci_dir(node, job))


def test_a_container_step_survives_upgrade_supervisors(node: Node, rootfs: str,
                                                       alice: User) -> None:
    work = home_for(node, alice)
    node.start()
    gate = os.path.join(work, "gate")
    job = submit_as(alice, node, work, "--container", rootfs, "--", "sh", "-c",
                    f"while ! test -e {gate}; do sleep 0.05; done; kill -TERM $$")
    node.wait_state(job, ("running",))
    res = node.cli("upgrade-supervisors")
    assert res.returncode == 0 and f"job {job}: supervisor" in res.stdout, res.stdout + res.stderr
    with open(gate, "w"):
        pass
    end = node.wait_end(job)
    # the re-executed supervisor still reads the runtime's 128+15 as the container's SIGTERM
    assert (end["state"], end["signal"]) == ("failed", signal.SIGTERM), end
    assert wait_gone(oci_dir(node, job))


def test_runc_and_root_inside_only_where_the_node_allows_it(make_node: type[Node],
                                                             alice: User) -> None:
    need("runc", "runc")
    need("crun", "crun")
    strict = make_node()
    shared(strict)
    rootfs = make_rootfs(os.path.join(strict.dir, "rootfs"))
    work = home_for(strict, alice)
    strict.start()
    for opts in (["--container-runtime", "runc"], ["--container-remap-root"]):
        res = cli_as(alice, strict, "submit", "--container", rootfs, *opts, "--", "true",
                     cwd=work)
        assert res.returncode == 1 and "--container-remap-root" in res.stderr, res
    allowing = make_node(extra=["--container-remap-root"])
    shared(allowing)
    rootfs = make_rootfs(os.path.join(allowing.dir, "rootfs"))
    work = home_for(allowing, alice)
    allowing.start()
    script = "id -u; cat /etc/marker; touch mine; cat /proc/self/cgroup; kill -TERM $$"
    runc = submit_as(alice, allowing, work, "--container-runtime", "runc", "--container", rootfs,
                     "--", "sh", "-c", script)
    end = allowing.wait_end(runc)
    assert (end["state"], end["signal"]) == ("failed", signal.SIGTERM), end
    lines = output(allowing, runc).splitlines()
    assert lines[:2] == ["0", "inside"], lines
    assert any("tether-" in ln for ln in lines if ":memory:" in ln), lines  # the step's cgroup
    # root inside, herself outside
    assert os.stat(os.path.join(work, "mine")).st_uid == alice.uid
    assert wait_gone(oci_dir(allowing, runc))


def oci_archive(where: str, rootfs: str) -> str:
    """An OCI image archive (a tar of an OCI image layout) made with umoci, whose config sets
    FOO and PATH, from ``rootfs``."""
    layout, bundle = os.path.join(where, "layout"), os.path.join(where, "bundle")

    def umoci(*args: str) -> None:
        subprocess.run(["umoci", *args], check=True, capture_output=True)

    umoci("init", "--layout", layout)
    umoci("new", "--image", f"{layout}:t")
    umoci("unpack", "--image", f"{layout}:t", bundle)
    for name in os.listdir(rootfs):
        src = os.path.join(rootfs, name)
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, os.path.join(bundle, "rootfs", name), symlinks=True,
                            dirs_exist_ok=True)
    umoci("repack", "--image", f"{layout}:t", bundle)
    umoci("config", "--image", f"{layout}:t", "--config.env", "FOO=from-image",
          "--config.env", "PATH=/bin")
    archive = os.path.join(where, "image.tar")
    subprocess.run(["tar", "-C", layout, "-cf", archive, "."], check=True)
    return archive


def test_images_are_imported_listed_and_run_by_name(node: Node, rootfs: str,
                                                    alice: User) -> None:
    need("umoci", "umoci")
    need("skopeo", "skopeo")
    work = home_for(node, alice)
    made = os.path.join(node.dir, "made")
    os.mkdir(made)
    archive = oci_archive(made, rootfs)
    tarball = os.path.join(made, "rootfs.tar")
    subprocess.run(["tar", "-C", rootfs, "-cf", tarball, "."], check=True)
    node.start()
    node.ok("image", "import", "busy", archive)
    node.ok("image", "import", "plain", tarball)
    listed = json.loads(node.ok("image", "list", "--json"))
    assert [(i["name"], i["kind"]) for i in listed] == [("busy", "oci"), ("plain", "rootfs")]
    assert "busy" in node.ok("image", "list")
    res = node.cli("image", "import", "busy", archive)
    assert res.returncode == 1 and "exists" in res.stderr, res
    res = node.cli("image", "import", "../x", archive)
    assert res.returncode == 2, res
    script = "echo foo=$FOO path=$PATH; cat /etc/marker"
    job = submit_as(alice, node, work, "--container", "busy", "--", "sh", "-c", script)
    end = node.wait_end(job)
    assert (end["state"], end["exit_code"]) == ("completed", 0), (end, output(node, job))
    # the image's environment, and its PATH over the submitter's
    assert output(node, job).splitlines() == ["foo=from-image path=/bin", "inside"]
    job = submit_as(alice, node, work, "--container", "plain", "--", "cat", "/etc/marker")
    end = node.wait_end(job)
    assert (end["state"], output(node, job)) == ("completed", "inside\n"), end
    res = cli_as(alice, node, "submit", "--container", "nosuch", "--", "true", cwd=work)
    assert res.returncode == 2 and "no such image" in res.stderr, res


def test_a_batch_script_runs_inside_from_its_copy(node: Node, rootfs: str, alice: User) -> None:
    """The script's copy is handed over on an fd (moved to 3 inside): its #! interpreter is
    the container's."""
    work = home_for(node, alice)
    script = os.path.join(work, "job.sh")
    with open(script, "w") as f:
        f.write("#!/bin/sh\n#SBATCH --job-name=inbox\ncat /etc/marker; echo args=$1 "
                "name=$TETHER_JOB_NAME\n")
    os.chown(script, alice.uid, alice.gid)
    node.start()
    job = submit_as(alice, node, work, "--container", rootfs, script, "one")
    end = node.wait_end(job)
    assert (end["state"], end["exit_code"]) == ("completed", 0), (end, output(node, job))
    assert output(node, job).splitlines() == ["inside", "args=one name=inbox"]


def test_root_never_reads_what_a_link_in_her_directory_points_at(node: Node, rootfs: str,
                                                                 alice: User) -> None:
    """The task's directory is hers: a link she puts where the runtime's log was is not
    followed when the supervisor (root) looks for the runtime's error."""
    work = home_for(node, alice)
    node.start()
    gate = os.path.join(work, "gate")
    job = submit_as(alice, node, work, "--container", rootfs, "--", "sh", "-c",
                    f"while ! test -e {gate}; do sleep 0.05; done; exit 1")
    node.wait_state(job, ("running",))
    log = os.path.join(oci_dir(node, job), "r0", "runtime.log")
    poll_until(lambda: os.path.exists(log), 20, "the runtime's log")
    # a file only root may read, in the runtime's log format
    secret = os.path.join(node.dir, "secret.json")
    with open(secret, "w") as f:
        f.write('{"level": "error", "msg": "ROOT-ONLY"}\n')
    os.chmod(secret, 0o600)
    res = run_as(alice, ["-c", f"import os; os.unlink({log!r}); "
                               f"os.symlink({secret!r}, {log!r})"])
    assert res.returncode == 0, res.stderr
    with open(gate, "w"):
        pass
    end = node.wait_end(job)
    assert (end["state"], end["exit_code"], end["reason"]) == ("failed", 1, None), end


def test_the_agent_refuses_a_hostile_container_argument(node: Node) -> None:
    """The request is checked again (every local user is hostile), and nothing is queued."""
    from tether.shared.client import Client

    node.start()
    good = {"command": ["true"], "workdir": node.work, "env": {}}
    with Client(node.layout.sock) as c:
        for value, why in (
                ("/rootfs", "must be a map"),
                ({"rootfs": "r"}, "must be an absolute path"),
                ({"rootfs": "/r", "hooks": {"prestart": []}}, "unknown field"),
                ({"rootfs": "/r", "mounts": [["/a", "b", False]]}, "must be an absolute path"),
                ({"rootfs": "/r", "runtime": "/tmp/evil"}, "unknown container runtime"),
                ({"rootfs": "/r", "env": ["NOEQUALS"]}, "NAME=VALUE"),
                ({"rootfs": "/r", "runtime": "runc"}, "--container-remap-root"),
                ({"rootfs": "/r", "remap_root": True}, "--container-remap-root")):
            with pytest.raises(Exception, match=why):
                c.call("submit", dict(good, container=value))
    assert node.ok("list", "--json").strip() == "[]"
