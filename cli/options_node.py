"""The options of the verbs about the node and the cluster: ``agent``, ``status``, ``top``,
``upgrade-supervisors``, ``completion``, ``man``, ``cluster``, ``nodes`` and ``drain``.

Apart from ``parser.py``'s machinery for the same reason as ``options_jobs.py``; one
``add_<verb>`` function per verb.
"""

from __future__ import annotations

import argparse

from tether.cli.argtypes import (
    job_id,
    non_negative,
    positive,
    positive_days,
    positive_seconds,
    seconds,
    time_limit,
)
from tether.cli.verbs import add_json, verb

#: where the administrator's commands find the cluster's connection string
ADMIN_DSN_HELP = ("a root-only file (mode 0600) holding the database's connection string, as "
                  "the tables' owner (default: $TETHER_CLUSTER, else libpq's own defaults: "
                  "PGHOST, PGSERVICE, ~/.pgpass, peer authentication)")

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    from typing import Any


def add_agent(sub: Any) -> None:
    a = verb(sub, "agent", "run the node agent in the foreground",
             "Run the node agent in the foreground. SIGTERM or SIGINT stop it and leave every "
             "job running (a restarted agent takes them back); SIGHUP reloads the settings "
             "file and applies what can change while it runs (docs/operations.md).")
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
                   help="have every warm supervisor mark the pages it holds alone mergeable by "
                   "the kernel's same-page merging: less memory per step, at the "
                   "cost of a host-wide timing side channel (docs/operations.md); needs "
                   "/sys/kernel/mm/ksm/run = 1 (default off)")
    a.add_argument("--hwloc-xml", default="pmi", choices=["pmi", "all", "off"],
                   help="gather the node's hwloc topology once at start and have the tasks of "
                   "steps with PMI (all: of every step) load it as XML instead of discovering "
                   "it, ~10 ms of CPU less per MPI rank; off: every rank discovers it "
                   "(default pmi)")
    a.add_argument("--submit-check-timeout", type=positive_seconds, default=5.0,
                   metavar="SECONDS",
                   help="how long the check that a submitting user can enter the working "
                   "directory and write the outputs (run as that user) may take before it is "
                   "killed and the submission refused (default 5)")
    a.add_argument("--pmi-store-mb", type=positive, default=16, metavar="MB",
                   help="the most memory a step's PMI key-value store may hold, in MiB (each "
                   "entry counted with its overhead); a put past it is refused (default 16)")
    a.add_argument("--max-queued-per-user", type=non_negative, default=1000, metavar="N",
                   help="the most pending jobs one user may have (each array element "
                   "counted; Slurm's MaxSubmitJobs): a submission past it is refused; 0: no "
                   "limit; root's and the agent's user's own jobs are not limited (default "
                   "1000)")
    a.add_argument("--max-running-per-user", type=non_negative, default=1000, metavar="N",
                   help="the most jobs one user may have holding resources (Slurm's MaxJobs): "
                   "her others wait, reason QOSMaxJobsPerUserLimit; 0: no limit (default "
                   "1000)")
    a.add_argument("--max-user-records-mb", type=positive, default=64, metavar="MB",
                   help="the most of the state directory one user's job records may take "
                   "(commands, environments, names and paths of her jobs in the jobs table): "
                   "her oldest ended jobs are purged first, then a submission is refused "
                   "(default 64)")
    a.add_argument("--fairshare-half-life", type=time_limit, default=7 * 86400.0,
                   metavar="TIME",
                   help="the half-life of the usage (allocated CPU-seconds) pending jobs are "
                   "ordered by, fair share between users, in submit --time's notation "
                   "(Slurm's PriorityDecayHalfLife; default 7-0, 7 days)")
    a.add_argument("--keep-ended", type=positive_days, default=7.0, metavar="DAYS",
                   help="how long an ended job stays in the jobs table (list, show, wait) "
                   "before it is purged; the accounting history (tether acct) keeps it "
                   "(default 7)")
    a.add_argument("--keep-ended-count", type=positive, default=1000, metavar="N",
                   help="the most ended jobs of one user the jobs table keeps; older ones are "
                   "purged sooner (default 1000)")
    a.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log to stderr from this level on (default INFO)")
    a.add_argument("--stop-for-good", action="store_true",
                   help="SIGTERM and SIGINT also end the supervisor template, which otherwise "
                   "waits --template-linger for a restarted agent (systemctl stop)")
    a.add_argument("--template-linger", type=positive_seconds, default=300.0,
                   metavar="SECONDS",
                   help="how long the supervisor template stays once no agent runs: an agent "
                   "started again within it finds it warm (default 300)")
    a.add_argument("--metrics-file", metavar="PATH",
                   help="write the node's and its jobs' figures there for Prometheus, as a "
                   "node_exporter textfile (NAME.prom), replaced atomically (default: none)")
    a.add_argument("--metrics-interval", type=positive_seconds, default=15.0,
                   metavar="SECONDS", help="time between two writes of --metrics-file "
                   "(default 15)")
    a.add_argument("--cluster-file", metavar="FILE",
                   help="join a cluster: FILE holds this node's connection string (its own "
                   "database role and password, from `tether cluster add-node`), owned by "
                   "the agent's user and readable by no one else, as ssh wants a key; "
                   "default: $TETHER_CLUSTER in the agent's environment, else no cluster")
    a.add_argument("--cluster", metavar="DSN", help=argparse.SUPPRESS)  # refused: see cmd_agent
    a.add_argument("--login", action="store_true",
                   help="with a cluster: a login node, which serves its users' commands and "
                   "the cluster but owns no resources and runs no jobs")
    a.add_argument("--heartbeat", type=positive_seconds, metavar="SECONDS",
                   help="with a cluster: time between the node's heartbeats (default 2)")


def add_status(sub: Any) -> None:
    s = verb(sub, "status", "is the agent answering; what does it hold",
             "Ask the agent for its node, version, allocated resources and job counts. Exit 1 "
             "if no agent answers (with --json, {\"running\": false, \"error\": ...} on stdout "
             "too).")
    add_json(s, "the agent's status")


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


def add_upgrade(sub: Any) -> None:
    u = verb(sub, "upgrade-supervisors", "re-exec running supervisors into the installed tether",
             "Make each running step's supervisor re-execute itself into the installed tether, "
             "keeping its pid, its tasks, its socket and its state; exit 0 once each answers "
             "as the installed version (docs/operations.md). Root or the agent's user only.")
    u.add_argument("jobs", type=job_id, nargs="*", metavar="JOB",
                   help="job ids (default: every step with a live supervisor)")


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


def add_cluster(sub: Any) -> None:
    s = verb(sub, "cluster", "administer the cluster database (init, add-node)",
             "Administer the cluster's PostgreSQL database, as the role that owns tether's "
             "tables. People never need the database: their commands go to their node's agent.")
    csub = s.add_subparsers(dest="cluster_cmd", metavar="ACTION", parser_class=type(s),
                            required=True)
    init = csub.add_parser("init", prog="tether cluster init",
                           help="create or upgrade the schema (idempotent)",
                           description="Create the cluster's tables, the functions nodes act "
                           "through and their privileges, or bring them to this tether's "
                           "version; a second run changes nothing but the settings given.")
    init.add_argument("--cluster-file", metavar="FILE", help=ADMIN_DSN_HELP)
    init.add_argument("--heartbeat-timeout", type=positive_seconds, metavar="SECONDS",
                      help="how long a node may miss heartbeats before its own steps kill their "
                      "tasks; a timeout and --fence-margin later any live agent declares it "
                      "down and requeues its jobs (default 30; a re-init without it keeps the "
                      "current value)")
    init.add_argument("--fence-margin", type=positive_seconds, metavar="SECONDS",
                      help="how long after a lost node's steps fenced themselves (at the "
                      "heartbeat timeout) its jobs may run elsewhere (default 5; a re-init "
                      "without it keeps the current value)")
    init.add_argument("--requeue", choices=["yes", "no"],
                      help="the site's default for a job whose node is lost: run it again "
                      "(yes, Slurm's JobRequeue=1) or end it node_fail (no); submit "
                      "--no-requeue overrides it (default yes; a re-init without it keeps the "
                      "current value)")
    init.add_argument("--fairshare-half-life", type=time_limit, metavar="TIME",
                      help="the half-life of the usage the cluster's queue is ordered by, in "
                      "--time's notation (Slurm's PriorityDecayHalfLife; default 7-0, 7 days; "
                      "a re-init without it keeps the current value)")
    init.add_argument("--root-jobs", choices=["allow", "deny"],
                      help="may root's jobs run from the cluster (Slurm's DisableRootJobs; "
                      "default deny; a re-init without it keeps the current value)")
    add_json(init, "the schema version and settings")
    add = csub.add_parser("add-node", prog="tether cluster add-node",
                          help="create a node's database role; print what its agent needs",
                          description="Create the login role of node NAME (or give it a new "
                          "password) and print the connection string its agent needs, for a "
                          "root-only file on that node (agent --cluster-file).")
    add.add_argument("name", metavar="NAME", help="the node's name (the agent's --node)")
    add.add_argument("--cluster-file", metavar="FILE", help=ADMIN_DSN_HELP)
    add.add_argument("--role", metavar="ROLE", help="its role's name (default tether_NAME)")
    add.add_argument("--host", metavar="HOST",
                     help="the database's host as the node reaches it (default: as this "
                     "command reached it)")
    add.add_argument("--write", metavar="FILE",
                     help="write the connection string to FILE (created mode 0600) instead of "
                     "printing it")
    add_json(add, "the node, role and connection string")
    down = csub.add_parser("node-down", prog="tether cluster node-down",
                           help="a node known to be off: run its jobs elsewhere now",
                           description="Declare node NAME down at once, as an administrator "
                           "who knows it is off (powered down, fenced by other means): its jobs "
                           "are requeued (or end node_fail) without waiting for the heartbeat "
                           "timeout. If it is in fact running, its jobs may run twice: hence "
                           "--confirm-dead.")
    down.add_argument("name", metavar="NAME", help="the node")
    down.add_argument("--confirm-dead", action="store_true",
                      help="required: the node and every process of its jobs are gone")
    down.add_argument("--cluster-file", metavar="FILE", help=ADMIN_DSN_HELP)
    add_json(down, "what was done: the node, jobs requeued, jobs ended")


def add_nodes(sub: Any) -> None:
    s = verb(sub, "nodes", "list the cluster's nodes (on a cluster's node)",
             "List the cluster's nodes: state (up, down, draining), CPUs, GPUs and memory "
             "allocated/total, running jobs, last heartbeat, version.")
    add_json(s, "an array of node objects")


def add_drain(sub: Any) -> None:
    s = verb(sub, "drain", "stop new work going to a node (root, on a cluster's node)",
             "Stop new work going to NODE; its running jobs go on. Root only.")
    s.add_argument("node", metavar="NODE", help="node name")
