"""The options of the verbs about jobs: ``submit``, ``list``, ``show``, ``wait``, ``cancel``,
``hold``, ``release``, ``inspect``, ``attach``, ``signal``, ``suspend`` and ``resume``.

Apart from ``parser.py``'s machinery (the Parser, its errors and ``build_parser``) so that each
file stays readable; ``build_parser`` imports this module only for the verbs it has. One
``add_<verb>`` function per verb, each starting from ``verbs.verb`` (not from parser.py, which
imports this module).
"""

from __future__ import annotations

import argparse

from tether.cli.argtypes import (
    array_spec,
    begin_time,
    dependency,
    env_pair,
    export_spec,
    job_ref,
    mem_size,
    non_negative,
    positive,
    seconds,
    time_limit,
)
from tether.cli.verbs import add_json, verb

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    from typing import Any


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
             "Queue a job: NTASKS copies of COMMAND, each with its own CPUs. Prints the job id. "
             "Without --, a SCRIPT (a file, not a program) is a batch script, as sbatch takes "
             "it: its copy runs (by its #! interpreter, else /bin/sh), and its #TETHER and "
             "#SBATCH lines give options before the command line's, which win.",
             usage="tether submit [OPTIONS] -- COMMAND [ARG...]\n"
             "       tether submit [OPTIONS] SCRIPT [ARG...]",
             epilog=OUTPUT_HELP + "\n\nexamples:\n  tether submit --cpus 2 -- ./prog --in data\n"
             "  tether submit --ntasks 4 --pmi pmi1 --wait -- ./mpi_prog\n"
             "  tether submit -n 4 -c 2 --mem 4G -t 1:00:00 -J sim -o sim-%j.out -- ./sim\n"
             "  tether submit job.sh input.dat      # job.sh: #SBATCH --ntasks=4 ...")
    # Slurm's spellings too (sbatch's short options, --job-name, --chdir, --mem, ...): each
    # one more name of the same option, so a Slurm user's command line means what it meant
    # there (docs/cli.md, "Slurm's options")
    s.add_argument("-c", "--cpus", "--cpus-per-task", type=positive, default=1, metavar="N",
                   help="CPUs per task: the job takes NTASKS x N (default 1)")
    s.add_argument("-G", "--gpus", type=non_negative, default=0, metavar="N",
                   help="GPUs for the whole job (default 0)")
    s.add_argument("--memory-mb", type=non_negative, default=0, metavar="MB",
                   help="memory for the whole job, in MiB, counted against the node's (default 0)")
    s.add_argument("--mem", dest="memory_mb", type=mem_size, default=argparse.SUPPRESS,
                   metavar="SIZE",
                   help="as --memory-mb, Slurm's way: N[K|M|G|T] (512M, 4G; no unit: MiB)")
    s.add_argument("-n", "--ntasks", type=positive, metavar="N",
                   help="tasks (ranks) to start, at most 1024 (default 1)")
    s.add_argument("--ntasks-per-node", type=positive, metavar="N",
                   help="Slurm's: on this one node, the number of tasks (as --ntasks, which "
                   "must then be the same number)")
    s.add_argument("-J", "--name", "--job-name", metavar="NAME",
                   help="job name, up to 256 characters (default: the command's base name)")
    s.add_argument("-o", "--output", metavar="PATH",
                   help="file for the tasks' stdout; tokens below (default tether-%%N-%%j.out)")
    s.add_argument("-e", "--error", metavar="PATH",
                   help="file for the tasks' stderr; tokens below (default: the --output file)")
    s.add_argument("-D", "--workdir", "--chdir", metavar="DIR",
                   help="directory the tasks start in (default: the current directory)")
    s.add_argument("--export", type=export_spec, metavar="ALL|NONE|LIST",
                   help="which of your environment the job gets: ALL (the default; with "
                   "--user: NONE), NONE (only PATH=/usr/local/bin:/usr/bin:/bin), or NAME and "
                   "NAME=VALUE, comma-separated (only those, plus the rest with ALL in the "
                   "list); --env on top")
    s.add_argument("--env", type=env_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="set a variable on top of your environment (repeatable)")
    s.add_argument("--user", metavar="NAME",
                   help="run the tasks as this user (an agent running as root only)")
    s.add_argument("--pmi", choices=["none", "pmi1", "pmi2"], default="none",
                   help="serve PMI to the ranks from the step's supervisor, for MPI programs "
                   "(default none)")
    s.add_argument("-t", "--time", dest="time_limit", type=time_limit, metavar="TIME",
                   help="time limit: MINUTES, M:S, H:M:S, D-H, D-H:M or D-H:M:S; at the limit "
                   "the tasks get SIGTERM, then SIGKILL after the agent's --cancel-grace, and "
                   "the job ends 'timeout' (default: the agent's --default-time, else none)")
    s.add_argument("-a", "--array", type=array_spec, metavar="SPEC",
                   help="an array: one job per index, shown as ID_INDEX: N-M[:STEP] or "
                   "N,M,... (both mixed), then %%MAX to run at most MAX at once (0-99%%5); "
                   "TETHER_ARRAY_JOB_ID, TETHER_ARRAY_TASK_ID and TETHER_ARRAY_TASK_COUNT, _MIN, "
                   "_MAX, _STEP in the environment")
    s.add_argument("-d", "--dependency", type=dependency, metavar="LIST",
                   help="start only after other jobs: afterok:ID[:ID...] (completed), "
                   "afterany:ID (ended), afternotok:ID (ended otherwise), after:ID (started), "
                   "aftercorr:ID (the element of array ID of the same index completed), "
                   "singleton (no other job of yours with this name runs or waits ahead), "
                   "comma-separated, all needed; an array's ID (or ID_*) means all its elements "
                   "together, as Slurm's. One that can no longer be met cancels the job (reason "
                   "DependencyNeverSatisfied)")
    s.add_argument("-b", "--begin", type=begin_time, metavar="TIME",
                   help="start no earlier than TIME (reason BeginTime until then): now+N[s|m|h|"
                   "d] (seconds without a unit), HH:MM[:SS] (today, or tomorrow once past) or "
                   "YYYY-MM-DD[THH:MM[:SS]], local time")
    s.add_argument("-H", "--hold", action="store_true",
                   help="queue the job held: it starts only after 'tether release'")
    s.add_argument("-W", "--wait", action="store_true",
                   help="print the id, wait for the end and exit as 'tether wait' does")
    s.add_argument("--export-slurm-env", action="store_true",
                   help="give the tasks Slurm's names of the job variables too (SLURM_JOB_ID, "
                   "SLURM_PROCID, SLURM_ARRAY_TASK_ID, ...): never by default, since some MPI "
                   "libraries that see SLURM_* try to run srun")
    s.add_argument("--no-requeue", action="store_true",
                   help="on a cluster's node: if the job's node goes down, fail the job instead "
                   "of running it again elsewhere")
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


def add_acct(sub: Any) -> None:
    from tether.cli.cmd_acct import UNITS, fields_help
    from tether.cli.jobfilter import name_list, since, state_list

    s = verb(sub, "acct", "the accounting history of ended jobs (Slurm's sacct)",
             "The accounting history: one line per ended job, oldest first, with what its "
             "step used (CPU time, memory peak) as its supervisor measured it at the end. "
             "Kept after a job leaves 'list'. Your own jobs unless you name users, jobs or "
             "--all-users (root: everyone's).",
             usage="tether acct [OPTIONS] [JOB...]", epilog=fields_help())
    s.add_argument("jobs", type=job_ref, nargs="*", metavar="JOB",
                   help="only these jobs (an array's id: every element; ID_INDEX: one)")
    s.add_argument("-j", "--jobs", dest="job_list", type=job_list, metavar="JOB[,JOB...]",
                   help="as JOB..., sacct's way")
    s.add_argument("-u", "--user", type=name_list, metavar="USER[,USER...]",
                   help="only jobs that ran as these users")
    s.add_argument("-a", "--all-users", "--allusers", action="store_true",
                   help="every user's jobs")
    s.add_argument("-s", "--state", type=state_list, metavar="STATE[,STATE...]",
                   help="only jobs that ended so: completed, failed, cancelled, timeout, lost "
                   "(or Slurm's codes CD, F, CA, TO)")
    s.add_argument("--name", type=name_list, metavar="NAME[,NAME...]",
                   help="only jobs with exactly these names")
    s.add_argument("-S", "--since", "--starttime", type=since, metavar="TIME",
                   help="only jobs that ended at or after TIME: N[s|m|h|d|w] ago (minutes "
                   "without a unit), HH:MM[:SS] today or YYYY-MM-DD[THH:MM[:SS]], local time")
    s.add_argument("-E", "--until", "--endtime", type=since, metavar="TIME",
                   help="only jobs that started (or ended without starting) at or before TIME, "
                   "in --since's notation")
    s.add_argument("-o", "--format", metavar="FIELD[:WIDTH],...",
                   help="the columns, by name (listed below)")
    s.add_argument("-n", "--no-header", "--noheader", action="store_true",
                   help="leave out the header line")
    out = s.add_mutually_exclusive_group()
    out.add_argument("-p", "--parsable", action="store_true",
                     help="values whole, each followed by |, as sacct -p")
    out.add_argument("-P", "--parsable2", action="store_true",
                     help="values whole, separated by |, as sacct -P")
    out.add_argument("--json", action="store_true", help="print the records as JSON")
    s.add_argument("--units", choices=list(UNITS),
                   help="memory in KiB (K, the default: 102400K), MiB (M) or GiB (G)")


def job_list(text: str) -> list[str]:
    """sacct's ``-j 12,13_2``: job refs, comma-separated."""
    return [job_ref(word) for word in text.split(",") if word]


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


def add_suspend(sub: Any) -> None:
    s = verb(sub, "suspend", "freeze a running job (resume thaws it)",
             "Freeze every process of a running job (its cgroup's freezer) until `tether resume "
             "JOB`. Its state reads suspended, the time suspended is not counted in its "
             "elapsed time, it keeps its CPUs, and cancel still works. The job's owner or root.")
    s.add_argument("job", type=job_ref, metavar="JOB", help="job id, or ARRAY_INDEX")


def add_resume(sub: Any) -> None:
    s = verb(sub, "resume", "thaw a suspended job; or let a drained node take work again",
             "With a job id (digits, or ARRAY_INDEX such as 12_3): thaw a job that `tether "
             "suspend` froze. Anything else names a node of the cluster: let a drained node take "
             "work again (root).")
    s.add_argument("node", metavar="JOB|NODE", help="a job id, or a node name")
