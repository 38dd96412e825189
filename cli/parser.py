"""The argument tree of ``tether``: every verb, option, unit and default, in one place.

Built on every run, so it imports nothing beyond argparse and the converters: each verb's own
imports happen only when that verb runs (``main.VERBS``). One ``add_<verb>`` function per verb so
that options added later land in separate hunks. ``allow_abbrev=False`` everywhere: an option
prefix is an error, never silently another option (``--state`` is not ``--state-dir``), so that
adding an option can never change what an existing command line means.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from tether.cli.argtypes import (
    array_spec,
    begin_time,
    dependency,
    env_pair,
    job_id,
    job_ref,
    non_negative,
    positive,
    positive_seconds,
    seconds,
    time_limit,
)
from tether.cli.errors import EXIT_USAGE, CliError

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    from typing import Any, NoReturn

CLUSTER_HELP = ("PostgreSQL DSN of a cluster: jobs, nodes and results are the cluster's (default: "
                "$TETHER_CLUSTER; with neither, this node's agent alone)")
STATE_DIR_HELP = ("the agent's state directory (default: $TETHER_STATE_DIR, else /var/lib/tether "
                  "for root, else $XDG_STATE_HOME/tether or ~/.local/state/tether)")

EXIT_CODES = """exit codes:
  0    success
  1    an error: no agent answering, unknown job, request refused (one line on stderr)
  2    bad usage
  124  wait --timeout ran out
  130  interrupted (Ctrl-C)
  141  whoever read the output went away (tether list | head), as a SIGPIPE death
  wait and submit --wait exit with the job's own exit code, 128+N if signal N killed it"""


def _columns() -> int:
    """``shutil.get_terminal_size().columns``, without importing shutil (bz2, lzma, fnmatch:
    ~1.5 ms of every run, for argparse's formatter, which every ``add_argument`` creates)."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns or 80  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 80
    return columns


class Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        super().__init__(prog, indent_increment, max_help_position,
                         _columns() - 2 if width is None else width)  # as argparse's own


class Parser(argparse.ArgumentParser):
    """Errors as one CliError line (with a suggestion for a near miss); never abbreviations."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{self.prog}: {self.explain(message)}", EXIT_USAGE)

    def explain(self, message: str) -> str:
        """argparse's message, with a suggestion when the mistake is close to a real name."""
        m = re.match(r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if m:
            what, given = m.group(1), m.group(2)
            choices = re.findall(r"'([^']*)'", m.group(3))
            hint = suggest(given, choices)
            if what == "COMMAND":
                return f"'{given}' is not a command{hint} ('{self.prog} --help' lists them)"
            return f"argument {what}: invalid choice '{given}'{hint} (choose from " \
                   f"{', '.join(choices)})"
        return message

    def parse(self, args: list[str]) -> argparse.Namespace:
        """As parse_args, but an unknown option is reported by the subcommand it was given to,
        with a suggestion from that subcommand's own options."""
        ns, extras = self.parse_known_args(args)
        if extras:
            owner = self
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction) and getattr(ns, "cmd", None):
                    owner = action.choices[ns.cmd]
            hint = ""
            if extras[0].startswith("--"):
                names = [o for a in owner._actions for o in a.option_strings]
                hint = suggest(extras[0].partition("=")[0], names)
            owner.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return ns

    def subcommand(self, name: str) -> Parser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub: Parser = action.choices[name]
                return sub
        raise KeyError(name)


def suggest(given: str, names: list[str]) -> str:
    import difflib  # only for a mistake

    close = difflib.get_close_matches(given, sorted(set(names)), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def verb(sub: Any, name: str, help: str, description: str = "", usage: str | None = None,
         epilog: str | None = None) -> Parser:
    """A subcommand with the shared ``--state-dir`` (accepted after the verb too)."""
    sp: Parser = sub.add_parser(name, prog=f"tether {name}", help=help, usage=usage,
                                description=description or help[:1].upper() + help[1:] + ".",
                                epilog=epilog)
    # SUPPRESS: absent here means "keep what came before the verb", not "set to None".
    sp.add_argument("--state-dir", metavar="DIR", default=argparse.SUPPRESS, help=STATE_DIR_HELP)
    sp.add_argument("--cluster", metavar="DSN", default=argparse.SUPPRESS, help=CLUSTER_HELP)
    return sp


def add_json(sp: Parser, what: str) -> None:
    sp.add_argument("--json", action="store_true", help=f"print {what} as JSON")


def verb_of(argv: list[str]) -> str | None:
    """The command ``argv`` names (the first word after the global options), or None."""
    args = iter(argv)
    for arg in args:
        if arg in ("--state-dir", "--cluster"):
            next(args, None)
        elif arg.startswith(("--state-dir=", "--cluster=")):
            continue
        elif arg.startswith("-"):
            return None  # --help, --version, a mistake: the whole parser answers
        else:
            return arg
    return None


def build_parser(argv: list[str] | None = None) -> Parser:
    """Every command's parser; or, given the command line, only the parser of the command it
    names (each one costs its imports and its argparse set-up on every run)."""
    from tether import __version__

    p = Parser(prog="tether",
               usage="tether [-V] [--state-dir DIR] [--cluster DSN] COMMAND [OPTIONS] ...",
               description="Run jobs on this node, each step under its own long-lived supervisor.",
               epilog=EXIT_CODES + "\n\n'tether COMMAND --help' describes each command.")
    p.add_argument("-V", "--version", action="version", version=f"tether {__version__}",
                   help="print the version and exit")
    p.add_argument("--state-dir", metavar="DIR", help=STATE_DIR_HELP)
    p.add_argument("--cluster", metavar="DSN", help=CLUSTER_HELP)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=Parser, title="commands")
    adders = (add_agent, add_status, add_submit, add_list, add_show, add_wait, add_cancel,
              add_hold, add_release, add_inspect, add_attach, add_signal, add_top, add_upgrade,
              add_completion, add_man, add_cluster, add_nodes, add_drain, add_suspend, add_resume)
    name = verb_of(argv) if argv is not None else None
    one = [a for a in adders if name is not None and _VERB_OF_ADDER.get(
        a.__name__, a.__name__[4:].replace("_", "-")) == name]
    if one:
        one[0](sub)
        if name in sub.choices:
            return p
        return build_parser()  # an adder named unlike its verb: everything, to be sure
    for add in adders:
        add(sub)
    return p


#: adders whose verb is not their name after ``add_``
_VERB_OF_ADDER = {"add_upgrade": "upgrade-supervisors"}


def add_agent(sub: Any) -> None:
    a = verb(sub, "agent", "run the node agent in the foreground",
             "Run the node agent in the foreground. SIGTERM, SIGINT or SIGHUP stop it and leave "
             "every job running; a restarted agent takes them back.")
    a.add_argument("--config", metavar="FILE",
                   help="settings file: KEY = VALUE per option above or below, named without "
                   "the dashes (cpus = 8, cancel-grace = 30); options given here override it "
                   "(default /etc/tether/agent.toml, if it exists)")
    a.add_argument("--cpus", type=positive, metavar="N",
                   help="CPU ids 0..N-1, at most the CPUs this process may run on unless "
                   "--oversubscribe (default: the CPUs this process may run on)")
    a.add_argument("--gpus", type=non_negative, default=0, metavar="N",
                   help="GPUs to hand out, ids 0..N-1 (default 0)")
    a.add_argument("--memory-mb", type=non_negative, metavar="MB",
                   help="memory to hand out, in MiB (default: MemTotal of /proc/meminfo)")
    a.add_argument("--node", metavar="NAME", help="node name (default: the host name)")
    a.add_argument("--cancel-grace", type=seconds, default=10.0, metavar="SECONDS",
                   help="time between SIGTERM and SIGKILL when a job is cancelled (default 10)")
    a.add_argument("--default-time", type=time_limit, metavar="TIME",
                   help="time limit of a job submitted without --time, in submit --time's "
                   "notation (default: none)")
    a.add_argument("--max-time", type=time_limit, metavar="TIME",
                   help="the longest time limit a job may ask for; a submission over it is "
                   "refused (default: no maximum)")
    a.add_argument("--oversubscribe", action="store_true",
                   help="allow --cpus beyond the CPUs this process may run on: the logical ids "
                   "are mapped onto the real ones, several to a CPU (status says so)")
    a.add_argument("--claim-timeout", type=seconds, default=120.0, metavar="SECONDS",
                   help="how long a new supervisor waits for the agent to claim it before it "
                   "gives up (default 120)")
    a.add_argument("--linger", type=seconds, default=3600.0, metavar="SECONDS",
                   help="how long a supervisor keeps a result nobody acknowledged (default 3600)")
    a.add_argument("--cgroup", default="auto", choices=["auto", "v2", "hybrid", "v1", "none"],
                   help="contain each step in a cgroup: v2; hybrid (v1 memory, cgroup2 for "
                   "tracking, kill and freeze); the v1 hierarchies (memory, pids, freezer, "
                   "cpuacct); or none (process groups only). auto: v2 where it has the memory "
                   "controller, else hybrid, else v1, else v2 for tracking alone, else none "
                   "(default auto)")
    a.add_argument("--cgroup-base", metavar="PATH",
                   help="where steps' cgroups go, in each hierarchy: relative to the agent's own "
                   "cgroup, or absolute from the hierarchy's root (default tether-HASH, HASH "
                   "from the state directory, so that two agents never share one)")
    a.add_argument("--default-memory-mb", type=non_negative, default=0, metavar="MB",
                   help="memory limit of a job submitted without --memory-mb, in MiB; 0: "
                   "unlimited but accounted (default 0)")
    a.add_argument("--ksm", action="store_true",
                   help="mark the supervisor template's memory, and so every warm supervisor's, "
                   "mergeable by the kernel's same-page merging: less memory per step, at the "
                   "cost of a host-wide timing side channel (docs/operations.md); needs "
                   "/sys/kernel/mm/ksm/run = 1 (default off)")
    a.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log to stderr from this level on (default INFO)")
    a.add_argument("--heartbeat", type=positive_seconds, metavar="SECONDS",
                   help="with --cluster: time between the node's heartbeats (default 2)")


def add_status(sub: Any) -> None:
    s = verb(sub, "status", "is the agent answering; what does it hold",
             "Ask the agent for its node, version, allocated resources and job counts. Exit 1 "
             "if no agent answers (with --json, {\"running\": false, \"error\": ...} on stdout "
             "too).")
    add_json(s, "the agent's status")


OUTPUT_HELP = """output file names (--output, --error; relative to --workdir), as Slurm's:
  %j  the job id              %A  the array's id (the job id outside an array)
  %x  the job name            %a  the array index (0 outside an array)
  %u  the user                %t  the task's rank: each task gets its own files
  %N  the node name           %%  a %
  A number after the % zero-pads (%4j: 0042). Default: tether-%N-%j.out for both streams.
  The files are truncated when the job starts; a command that cannot be executed leaves
  its reason in the error file."""


def add_submit(sub: Any) -> None:
    s = verb(sub, "submit", "queue a job",
             "Queue a job: NTASKS copies of COMMAND, each with its own CPUs. Prints the job id.",
             usage="tether submit [OPTIONS] -- COMMAND [ARG...]",
             epilog=OUTPUT_HELP + "\n\nexamples:\n  tether submit --cpus 2 -- ./prog --in data\n"
             "  tether submit --ntasks 4 --pmi pmi1 --wait -- ./mpi_prog")
    s.add_argument("--cpus", type=positive, default=1, metavar="N",
                   help="CPUs per task (Slurm's --cpus-per-task): the job takes NTASKS x N "
                   "(default 1)")
    s.add_argument("--gpus", type=non_negative, default=0, metavar="N",
                   help="GPUs for the whole job (default 0)")
    s.add_argument("--memory-mb", type=non_negative, default=0, metavar="MB",
                   help="memory for the whole job, in MiB, counted against the node's (default 0)")
    s.add_argument("--ntasks", type=positive, default=1, metavar="N",
                   help="tasks (ranks) to start, at most 1024 (default 1)")
    s.add_argument("--name", metavar="NAME",
                   help="job name, up to 256 characters (default: the command's base name)")
    s.add_argument("--output", metavar="PATH",
                   help="file for the tasks' stdout; tokens below (default tether-%%N-%%j.out)")
    s.add_argument("--error", metavar="PATH",
                   help="file for the tasks' stderr; tokens below (default: the --output file)")
    s.add_argument("--workdir", metavar="DIR",
                   help="directory the tasks start in (default: the current directory)")
    s.add_argument("--env", type=env_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="set a variable on top of your environment (repeatable)")
    s.add_argument("--user", metavar="NAME",
                   help="run the tasks as this user (an agent running as root only)")
    s.add_argument("--pmi", choices=["none", "pmi1", "pmi2"], default="none",
                   help="serve PMI to the ranks from the step's supervisor, for MPI programs "
                   "(default none)")
    s.add_argument("--time", dest="time_limit", type=time_limit, metavar="TIME",
                   help="time limit: MINUTES, M:S, H:M:S, D-H, D-H:M or D-H:M:S; at the limit "
                   "the tasks get SIGTERM, then SIGKILL after the agent's --cancel-grace, and "
                   "the job ends 'timeout' (default: the agent's --default-time, else none)")
    s.add_argument("--array", type=array_spec, metavar="SPEC",
                   help="an array: one job per index, shown as ID_INDEX: N-M[:STEP] or "
                   "N,M,... (both mixed), then %%MAX to run at most MAX at once (0-99%%5); "
                   "TETHER_ARRAY_JOB_ID and TETHER_ARRAY_TASK_ID in the environment")
    s.add_argument("--dependency", type=dependency, metavar="LIST",
                   help="start only after other jobs: afterok:ID[:ID...] (completed), "
                   "afterany:ID (ended), afternotok:ID (ended otherwise), comma-separated, all "
                   "needed; an array's ID means all its elements. One that can no longer be "
                   "met cancels the job (reason DependencyNeverSatisfied)")
    s.add_argument("--begin", type=begin_time, metavar="TIME",
                   help="start no earlier than TIME (reason BeginTime until then): now+N[s|m|h|"
                   "d] (seconds without a unit), HH:MM[:SS] (today, or tomorrow once past) or "
                   "YYYY-MM-DD[THH:MM[:SS]], local time")
    s.add_argument("--hold", action="store_true",
                   help="queue the job held: it starts only after 'tether release'")
    s.add_argument("--wait", action="store_true",
                   help="print the id, wait for the end and exit as 'tether wait' does")
    s.add_argument("--no-requeue", action="store_true",
                   help="with --cluster: if the job's node goes down, fail the job instead of "
                   "running it again elsewhere")
    add_json(s, "the job object (with --wait: the final one)")
    s.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def add_list(sub: Any) -> None:
    from tether.cli.jobfilter import add_filters, since
    from tether.cli.table import fields_help

    s = verb(sub, "list", "list jobs, oldest first",
             "List jobs, oldest first, one line each under a header. Filters combine: a job "
             "is listed when it passes every one given.", epilog=fields_help())
    add_filters(s, "jobs")
    s.add_argument("--since", type=since, metavar="TIME",
                   help="only jobs not ended before TIME: N[s|m|h|d|w] ago (minutes without a "
                   "unit), HH:MM[:SS] today or YYYY-MM-DD[THH:MM[:SS]], local time")
    s.add_argument("--format", metavar="FIELD[:WIDTH],...",
                   help="the columns, by name (listed below)")
    s.add_argument("--no-header", action="store_true", help="leave out the header line")
    add_json(s, "an array of job objects (filtered; --format does not apply)")


JOB_HELP = "job id, or ARRAY_INDEX for one element of an array"


def add_show(sub: Any) -> None:
    s = verb(sub, "show", "show one job")
    s.add_argument("job", type=job_ref, metavar="JOB", help=JOB_HELP)
    add_json(s, "the job object")


def add_wait(sub: Any) -> None:
    s = verb(sub, "wait", "wait for a job; exit with its exit code",
             "Wait for a job to end and exit with its exit code: 128+N if signal N killed it, "
             "1 if it ended without a code (or timed out without one), 124 if --timeout ran "
             "out. An array's id waits for every element and exits as its first element that "
             "did not complete. Waiting goes on through agent restarts.")
    s.add_argument("job", type=job_ref, metavar="JOB", help=JOB_HELP)
    s.add_argument("--timeout", type=seconds, metavar="SECONDS",
                   help="stop waiting after this long and exit 124 (default: no limit)")


def add_cancel(sub: Any) -> None:
    from tether.cli.jobfilter import add_filters

    s = verb(sub, "cancel", "cancel jobs",
             "Cancel jobs: SIGTERM to every task, SIGKILL after the agent's --cancel-grace; a "
             "pending job is simply cancelled. Name the jobs, or choose them with filters (then "
             "only pending, starting and running ones unless --state says otherwise), or both "
             "(the named jobs the filters let through). An array's id cancels every element "
             "not ended yet, ID_INDEX one element. Exit 1 if any named job could not be "
             "cancelled (each says why on its own line).",
             usage="tether cancel [OPTIONS] [JOB...]")
    s.add_argument("jobs", type=job_ref, nargs="*", metavar="JOB",
                   help="job ids (ID_INDEX: one element of an array)")
    add_filters(s, "jobs")


def add_hold(sub: Any) -> None:
    s = verb(sub, "hold", "keep pending jobs from starting",
             "Hold pending jobs: they stay queued (reason JobHeldUser) until released. An "
             "array's id holds its pending elements. The jobs' owner or root.",
             usage="tether hold [OPTIONS] JOB...")
    s.add_argument("jobs", type=job_ref, nargs="+", metavar="JOB",
                   help="job ids (ID_INDEX: one element of an array)")


def add_release(sub: Any) -> None:
    s = verb(sub, "release", "let held jobs start",
             "Release held jobs: they go back to waiting their turn. The jobs' owner or root.",
             usage="tether release [OPTIONS] JOB...")
    s.add_argument("jobs", type=job_ref, nargs="+", metavar="JOB",
                   help="job ids (ID_INDEX: one element of an array)")


def add_inspect(sub: Any) -> None:
    s = verb(sub, "inspect", "ask the job's supervisor directly (works while the agent is down)",
             "Ask the job's supervisor directly, so it works while the agent is down. Plain: the "
             "step's state, and the job's details when you may see them (its owner, root, the "
             "agent's user).")
    s.add_argument("job", type=job_ref, metavar="JOB", help=JOB_HELP)
    what = s.add_mutually_exclusive_group()
    what.add_argument("--pmi", action="store_true", help="the step's PMI state")
    what.add_argument("--pids", action="store_true",
                      help="every task and every other process of the step")
    what.add_argument("--stats", action="store_true",
                      help="CPU seconds, current and peak memory (KiB), elapsed seconds")
    what.add_argument("--output", action="store_true",
                      help="the last lines of the step's stdout (to stdout) and stderr (to "
                      "stderr)")
    what.add_argument("--events", action="store_true",
                      help="the step's events so far (tasks started and exited, step ended)")
    s.add_argument("--lines", type=non_negative, metavar="N",
                   help="with --output: how many lines of each (default 10)")
    add_json(s, "the supervisor's reply")


def add_attach(sub: Any) -> None:
    s = verb(sub, "attach", "follow the step's output until it ends (Ctrl-C detaches)",
             "Print what the step has written so far, then follow it until the step ends, each "
             "byte once. Ctrl-C detaches; the job keeps running.")
    s.add_argument("job", type=job_ref, metavar="JOB", help=JOB_HELP)


def add_signal(sub: Any) -> None:
    s = verb(sub, "signal", "send a signal to the step's tasks",
             "Send a signal to the process group of every live task of the step, or of one.")
    s.add_argument("job", type=job_ref, metavar="JOB", help=JOB_HELP)
    s.add_argument("signal", metavar="SIGNAL",
                   help="a name with or without SIG, any case (TERM, sigusr1, RTMIN+1) or a number")
    s.add_argument("--rank", type=non_negative, metavar="R",
                   help="only this task (default: every task)")


def add_upgrade(sub: Any) -> None:
    u = verb(sub, "upgrade-supervisors", "re-exec running supervisors into the installed tether",
             "Make each running step's supervisor re-execute itself into the installed tether, "
             "keeping its pid, its tasks, its socket and its state; exit 0 once each answers "
             "as the installed version (docs/operations.md). Root or the agent's user only.")
    u.add_argument("jobs", type=job_id, nargs="*", metavar="JOB",
                   help="job ids (default: every step with a live supervisor)")


def add_cluster(sub: Any) -> None:
    s = verb(sub, "cluster", "set up the cluster database (tether cluster init)",
             "Administer the cluster's PostgreSQL database.")
    csub = s.add_subparsers(dest="cluster_cmd", metavar="ACTION", parser_class=Parser,
                            required=True)
    init = csub.add_parser("init", prog="tether cluster init",
                           help="create or upgrade the schema (idempotent)",
                           description="Create the cluster's tables, or bring them to this "
                           "tether's schema version; a second run changes nothing.")
    init.add_argument("--cluster", metavar="DSN", default=argparse.SUPPRESS, help=CLUSTER_HELP)
    init.add_argument("--heartbeat-timeout", type=positive_seconds, metavar="SECONDS",
                      help="how long a node may miss heartbeats before any live agent declares "
                      "it down and requeues its jobs (default 30; a re-init without it keeps "
                      "the current value)")
    add_json(init, "the schema version and timeout")


def add_nodes(sub: Any) -> None:
    s = verb(sub, "nodes", "list the cluster's nodes (with --cluster)",
             "List the cluster's nodes: state (up, down, draining), CPUs, GPUs and memory "
             "allocated/total, running jobs, last heartbeat, version.")
    add_json(s, "an array of node objects")


def add_drain(sub: Any) -> None:
    s = verb(sub, "drain", "stop new work going to a node (with --cluster)",
             "Stop new work going to NODE; its running jobs go on.")
    s.add_argument("node", metavar="NODE", help="node name")


def add_suspend(sub: Any) -> None:
    s = verb(sub, "suspend", "freeze a running job (resume thaws it)",
             "Freeze every process of a running job (its cgroup's freezer) until `tether resume "
             "JOB`. Its state reads suspended, the time suspended is not counted in its "
             "elapsed time, it keeps its CPUs, and cancel still works. The job's owner or root.")
    s.add_argument("job", type=job_ref, metavar="JOB", help="job id, or ARRAY_INDEX")


def add_resume(sub: Any) -> None:
    s = verb(sub, "resume", "thaw a suspended job; or let a drained node take work again",
             "With a job id (digits, or ARRAY_INDEX such as 12_3): thaw a job that `tether "
             "suspend` froze. Anything else names a node: let a drained node take work again "
             "(with --cluster).")
    s.add_argument("node", metavar="JOB|NODE", help="a job id, or a node name")


def add_completion(sub: Any) -> None:
    s = verb(sub, "completion", "print a shell completion script",
             "Print a completion script for bash or zsh, written from this very parser.",
             epilog="examples:\n  source <(tether completion bash)       # this shell\n"
             "  tether completion bash > /etc/bash_completion.d/tether\n"
             "  tether completion zsh > \"${fpath[1]}/_tether\"")
    s.add_argument("shell", choices=["bash", "zsh"], help="the shell: bash or zsh")


def add_man(sub: Any) -> None:
    verb(sub, "man", "print the manual page (roff)",
         "Print the manual page, written from this very parser, as roff.",
         epilog="examples:\n  tether man | man -l -\n  tether man > /usr/local/share/man/man1/"
         "tether.1")


def add_top(sub: Any) -> None:
    s = verb(sub, "top", "a live view of the node: allocations, running and pending jobs",
             "A live full-screen view of the node, refreshed every --interval: the agent's "
             "allocations, the running jobs with their CPU use (percent of one CPU since the "
             "last refresh) and memory from their supervisors, the pending jobs with the reason "
             "they wait, the last jobs to end. q or Ctrl-C quits. When stdout is not a terminal it "
             "prints one plain snapshot per refresh instead.")
    s.add_argument("--interval", type=positive_seconds, default=1.0, metavar="SECONDS",
                   help="time between refreshes (default 1)")
    s.add_argument("--iterations", type=positive, metavar="N",
                   help="stop after N refreshes (default: until Ctrl-C)")
