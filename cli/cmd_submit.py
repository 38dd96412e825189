"""``submit`` and ``wait``."""

from __future__ import annotations

import os
import sys
import time

from tether.cli.argtypes import ref_args
from tether.cli.connect import agent_call
from tether.cli.errors import EXIT_TIMEOUT, EXIT_USAGE, CliError
from tether.cli.format import exit_status, say

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    import argparse

    from tether.shared.paths import Layout

#: The PATH of a job submitted for another user (``--user``): nothing of the submitter's.
USER_PATH = "/usr/local/bin:/usr/bin:/bin"


def current_umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it; put it back at once
    os.umask(mask)
    return mask


def submit(layout: Layout, ns: argparse.Namespace) -> int:
    command = list(ns.command)
    explicit = bool(command) and command[0] == "--"  # a command, as given: never a script
    if explicit:
        command = command[1:]
    if not command:
        raise CliError("submit: missing the command to run (tether submit [OPTIONS] -- CMD, "
                       "or tether submit [OPTIONS] SCRIPT [ARG...])", EXIT_USAGE)
    script = None
    if not explicit and getattr(ns, "argv", None) is not None:
        from tether.cli import batch  # only for a first word that may be a script

        script = batch.load(command[0])
        if script is not None:  # Slurm's batch script: its copy runs, its directives apply
            ns = batch.apply(ns, command[0], script)
            command = [os.path.abspath(command[0]), *command[1:]]
    env = environment(ns)
    workdir = os.path.abspath(ns.workdir or os.getcwd())
    args = {"command": command, "cpus": ns.cpus, "gpus": ns.gpus, "memory_mb": ns.memory_mb,
            "ntasks": ntasks(ns), "workdir": workdir, "env": env, "pmi": ns.pmi,
            "umask": current_umask()}
    for key in ("name", "output", "error", "user", "time_limit", "array", "dependency",
                "begin"):
        if getattr(ns, key) is not None:
            args[key] = getattr(ns, key)
    if ns.hold:
        args["hold"] = True
    if script is not None:
        args["script"] = script
    if getattr(ns, "export_slurm_env", False):
        args["slurm_env"] = True
    if getattr(ns, "no_requeue", False):
        args["requeue"] = False
    if os.geteuid() == 0:
        root_owned(layout)
    from tether.shared.framing import FrameTooLarge  # the client has it loaded already

    try:
        job = agent_call(layout, "submit", args)
    except FrameTooLarge as exc:  # a request is one frame: environment, command and script
        what = f"the script ({len(script)} bytes), " if script is not None else ""
        raise CliError(f"submit: the submission is {exc.size} bytes, over the {1 << 20} a "
                       f"request may be: {what}the environment and the command line together "
                       "(pass fewer variables: --export)") from None
    if ns.json and not ns.wait:
        from tether.cli.jsonout import dumps  # json.dumps's text, without json (~3 ms)

        print(dumps(job))
    else:
        print(job["id"], flush=True)
    if ns.wait:
        return wait_for(layout, str(job["id"]), None, as_json=ns.json)
    return 0


def environment(ns: argparse.Namespace) -> dict[str, str]:
    """The job's environment: the submitter's, as sbatch's default --export=ALL (the agent adds
    none of its own), or what --export names; --env on top. For another user (root's --user)
    nothing of root's shell goes along unless --export names it: a plain PATH and --env."""
    export = getattr(ns, "export", None)
    if export is None:
        export = ("NONE", ()) if ns.user is not None else ("ALL", ())
    base, names = export
    env = dict(os.environ) if base == "ALL" else {"PATH": USER_PATH}
    env["TETHER_SUBMIT_DIR"] = os.getcwd()  # Slurm's SLURM_SUBMIT_DIR: where submit ran
    for name, value in names:
        if value is not None:
            env[name] = value
        elif name in os.environ:  # Slurm's NAME alone: its value here, if it has one
            env[name] = os.environ[name]
    env.update(dict(ns.env))
    return env


def ntasks(ns: argparse.Namespace) -> int:
    """--ntasks, or Slurm's --ntasks-per-node: on one node, both name the number of tasks."""
    per_node = getattr(ns, "ntasks_per_node", None)
    if per_node is not None and ns.ntasks is not None and ns.ntasks != per_node:
        raise CliError(f"submit: --ntasks {ns.ntasks} and --ntasks-per-node {per_node} differ: "
                       "a job runs on one node, so both are its number of tasks", EXIT_USAGE)
    return int(ns.ntasks or per_node or 1)


def root_owned(layout: Layout) -> None:
    """Root's environment goes only to an agent root owns: a state directory or socket of
    another user's may be that user's own fake agent (TETHER_STATE_DIR pointed at it)."""
    for path, loose in ((layout.state_dir, 0o022), (layout.sock, 0)):  # any user connects
        try:
            st = os.lstat(path)
        except OSError:
            return  # nobody there: the call says so
        if st.st_uid != 0 or st.st_mode & loose:
            raise CliError(f"submit: {path} belongs to uid {st.st_uid} (mode "
                           f"{st.st_mode & 0o7777:04o}): root's environment goes only to an "
                           "agent whose state directory and socket root owns, writable by no "
                           "one else")


def wait_for(layout: Layout, job: str, timeout: float | None, as_json: bool = False) -> int:
    """Wait for ``job`` (an id, an array's id: every element, or ``ID_INDEX``)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    warned = False
    while True:
        left = 30.0 if deadline is None else deadline - time.monotonic()
        if left <= 0:
            print(f"tether: job {job} did not end within {timeout:g}s", file=sys.stderr)
            return EXIT_TIMEOUT
        hold = max(0.0, min(left, 30.0))
        try:
            res = agent_call(layout, "wait", dict(ref_args(job), hold=hold), timeout=hold + 10.0)
        except CliError as exc:
            # The agent may be restarting: keep waiting (the job does not depend on it).
            if not warned:
                say(f"tether: {exc}; still waiting", file=sys.stderr)
                warned = True
            time.sleep(min(0.05, max(0.0, left)))
            continue
        if res.get("done"):
            if as_json:
                from tether.cli.jsonout import dumps

                print(dumps(res["job"]))
            return exit_status(res["job"])


def wait(layout: Layout, ns: argparse.Namespace) -> int:
    agent_call(layout, "show", ref_args(ns.job))  # an unknown job is an error, not a wait
    return wait_for(layout, ns.job, ns.timeout)
