"""``agent --ksm``: each warm supervisor marks the pages it holds alone for kernel same-page
merging once its step runs (not the template's, not what it still shares with the template,
not its tasks'), a change of the setting replaces the template, and an agent whose kernel does
not merge says so and runs on."""

from __future__ import annotations

import os
import signal
import struct

import pytest

from tests.helpers import Node, poll_until
from tether.shared.procid import proc_stat
from tether.supervisor import ksm

KSM = "/sys/kernel/mm/ksm"


def mergeable(pid: int) -> bool:
    """Whether any mapping of ``pid`` carries VM_MERGEABLE (``mg`` in smaps' VmFlags)."""
    return marked_kib(pid) > 0


def marked_kib(pid: int) -> int:
    """The size of ``pid``'s mappings that carry VM_MERGEABLE."""
    size = total = 0
    with open(f"/proc/{pid}/smaps") as f:
        for ln in f:
            if ln.startswith("Size:"):
                size = int(ln.split()[1])
            elif ln.startswith("VmFlags:") and " mg" in ln:
                total += size
    return total


def private_dirty_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("Private_Dirty:"))


def ksmd_runs() -> bool:
    with open(os.path.join(KSM, "run")) as f:
        return f.read().strip() == "1"


def agent_log(node: Node) -> str:
    with open(node.agent_logs[-1]) as f:
        return f.read()


def pids_of(node: Node, job: int) -> tuple[int, int]:
    """The job's supervisor and its first task."""
    m = node.running_manifest(job)
    return int(m["supervisor"]["pid"]), int(m["tasks"][0]["pid"])


@pytest.mark.skipif(not os.path.exists(KSM), reason=f"no {KSM}: a kernel without KSM")
def test_ksm_supervisors_mark_their_own_copies_not_the_template_or_tasks(node: Node) -> None:
    node.start()
    plain = node.wait_template()
    job = node.submit("sleep", "60")
    sup, task = pids_of(node, job)
    assert not mergeable(plain) and not mergeable(sup) and not mergeable(task)
    assert "--ksm" not in agent_log(node)  # the log is the contract: it speaks of --ksm once set

    # the setting is part of the template's identity: the next agent replaces it
    node.stop(signal.SIGKILL)
    node.args.append("--ksm")
    ksmd_before = ksmd_runs()
    node.start()
    poll_until(lambda: proc_stat(plain) is None or proc_stat(plain).dead, 20,
               "the template without --ksm to leave")
    template = node.wait_template()
    job2 = node.submit("sleep", "60")
    sup2, task2 = pids_of(node, job2)
    poll_until(lambda: mergeable(sup2), 20, "the supervisor to mark its copies")
    # its own copies (~1,000 pages), joined across gaps of at most ksm.JOIN_GAP pages: not the
    # ~3,800 of the template's writable memory that it inherited, mostly still shared
    assert marked_kib(sup2) <= 2 * private_dirty_kib(sup2), (marked_kib(sup2),
                                                            private_dirty_kib(sup2))
    assert not mergeable(template), "the template marked its memory: every fork inherits it"
    assert not mergeable(task2), "a user's task is mergeable"
    assert not mergeable(sup)  # started before: unchanged
    if not ksmd_before and not ksmd_runs():  # (a bench --ksm may switch it meanwhile)
        # the log line is the contract here: the operator's only word that ksmd is off
        assert "--ksm has no effect until ksmd runs: echo 1 > " in agent_log(node)  # said only

    # the settings file says the same: the template is kept
    node.stop()
    config = os.path.join(node.dir, "agent.toml")
    with open(config, "w") as f:
        f.write("ksm = true\n")
    node.args.remove("--ksm")
    node.args += ["--config", config]
    node.start()
    assert node.wait_template() == template

    # and back: an agent without it replaces the marked template
    node.stop()
    node.args = node.args[:-2]
    node.start()
    poll_until(lambda: proc_stat(template) is None or proc_stat(template).dead, 20,
               "the --ksm template to leave")
    assert not mergeable(node.wait_template())
    for j in (job, job2):
        node.ok("cancel", str(j))
        assert node.wait_end(j)["state"] == "cancelled"


def test_runs_of_exclusive_pages_are_joined_across_small_gaps() -> None:
    present, excl = 1 << 63, 1 << 56
    page = ksm.PAGE
    mine, shared, absent = present | excl, present, 0
    layout = [mine, mine, shared, mine, absent, absent, absent, mine, shared, excl]
    entries = b"".join(struct.pack("=Q", e) for e in layout)
    base = 0x10000 * page
    assert ksm.exclusive_runs(base, entries, gap=0) == [
        (base, base + 2 * page), (base + 3 * page, base + 4 * page),
        (base + 7 * page, base + 8 * page)]  # not present: an exclusive bit alone is nothing
    assert ksm.exclusive_runs(base, entries, gap=1) == [
        (base, base + 4 * page), (base + 7 * page, base + 8 * page)]
    assert ksm.exclusive_runs(base, entries, gap=3) == [(base, base + 8 * page)]
    maps = ("7f00-7f10 rw-p 00000000 00:00 0\n7f10-7f20 r--p 00000000 08:01 12 /lib/x.so\n"
            "7f20-7f30 rw-s 00000000 00:01 5 /dev/zero\n7f30-7f40 rwxp 00000000 00:00 0 [heap]")
    assert ksm.private_writable_mappings(maps) == [(0x7f00, 0x7f10), (0x7f30, 0x7f40)]
