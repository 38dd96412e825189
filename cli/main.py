"""The ``tether`` command line: parse, run one verb, turn every failure into one stderr line.

Exit codes: 0 success; 1 an error (no agent, unknown job, refused request); 2 bad usage;
``wait`` exits with the job's own code, 128+N for signal N, and 124 on timeout; 130 when
interrupted (Ctrl-C; ``attach`` detaches and the job keeps running); 141 (as a SIGPIPE death)
when whoever reads our output goes away, silently.

Each verb lives in its own module, imported only when that verb runs, so that ``tether --help``
or a mistyped command never pays for ZeroMQ or the agent. ``inspect``, ``attach`` and ``signal``
talk to the job's supervisor directly (``shared.step_client``), never to the agent.

Start-up is most of what a short command costs (docs/cli.md, "Start-up"): argparse builds only
the parser of the verb named (``parser.build_parser``), modules import what only some paths need
where those paths begin, and ``entry`` (the console script) ends the process with ``os._exit``
once its output is flushed, instead of ~5 ms of interpreter finalization.
"""

from __future__ import annotations

import os
import sys

from tether.cli.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE, CliError

TYPE_CHECKING = False  # typing costs every CLI run ~2 ms: for the type checker only
if TYPE_CHECKING:
    import argparse
    from typing import Any

EXIT_PIPE = 141

# verb -> "module:function" under tether.cli; the function takes (Layout, Namespace).
VERBS = {
    "status": "cmd_show:status", "submit": "cmd_submit:submit", "list": "cmd_list:list_jobs",
    "show": "cmd_show:show", "wait": "cmd_submit:wait", "cancel": "cmd_cancel:cancel",
    "hold": "cmd_cancel:hold", "release": "cmd_cancel:release",
    "inspect": "cmd_inspect:inspect", "attach": "cmd_attach:attach",
    "signal": "cmd_attach:signal", "top": "cmd_top:top",
    "upgrade-supervisors": "cmd_upgrade:upgrade_supervisors",
    "suspend": "cmd_suspend:suspend", "resume": "cmd_suspend:resume", "acct": "cmd_acct:acct",
    "nodes": "cluster:cmd_nodes", "drain": "cluster:cmd_drain",
}
# verbs that need no agent: they take the Namespace only
LOCAL = {"completion": "completion:completion", "man": "manpage:man"}


def load(target: str) -> Any:
    module, _, func = target.partition(":")
    __import__(f"tether.cli.{module}")  # importlib itself is ~0.2 ms more of every run
    return getattr(sys.modules[f"tether.cli.{module}"], func)


def run(argv: list[str]) -> int:
    global _finalize
    from tether.cli.parser import build_parser

    parser = build_parser(argv)  # only the named verb's parser: each costs its set-up
    if not argv:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    ns = parser.parse(argv)
    if ns.cmd is None:  # only global options, e.g. `tether --state-dir X`
        raise CliError("tether: missing the command ('tether --help' lists them)", EXIT_USAGE)
    if ns.cmd in LOCAL:
        return int(load(LOCAL[ns.cmd])(ns))
    if ns.cmd == "agent":
        from tether.cli import agentconf

        _finalize = True  # a daemon: its threads, logging and database end the normal way
        agentconf.apply(parser.subcommand("agent"), ns, argv)
        reread = agentconf.rereader(parser, argv, state_dir)
        return int(load("cmd_agent:agent")(state_dir(ns), ns, reread))
    if ns.cmd == "cluster":  # the administrator's: straight to the database, as its owner
        from tether.cli.cluster import admin

        _finalize = True  # PostgreSQL's driver: leave its connections to end the normal way
        return admin(ns)
    from tether.shared.paths import Layout

    if ns.cmd == "submit":  # a batch script's directives are parsed with the options given
        ns.argv = argv
    layout = Layout(os.path.abspath(state_dir(ns)))
    if ns.cmd in ("inspect", "attach", "signal") and os.path.exists(layout.cluster_marker):
        from tether.cli.cluster import located  # a cluster's job: which node, which local id

        layout, ns = located(layout, ns)
    if ns.cmd == "top":
        _finalize = True  # rich, and the terminal it restores
    return int(load(VERBS[ns.cmd])(layout, ns))


#: set by ``run`` for the verbs whose process must end the normal way (``entry``)
_finalize = False


def state_dir(ns: argparse.Namespace) -> str:
    """--state-dir, else $TETHER_STATE_DIR, else the agent's settings file, else the default."""
    from tether.shared.paths import default_state_dir

    if ns.state_dir:
        return str(ns.state_dir)
    if os.environ.get("TETHER_STATE_DIR"):
        return default_state_dir()
    configured = getattr(ns, "config_state_dir", None)
    if configured is None and ns.cmd != "agent" and os.path.exists("/etc/tether/agent.toml"):
        from tether.cli.agentconf import client_state_dir

        configured = client_state_dir()
    return str(configured) if configured else default_state_dir()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        code = run(argv)
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at exit
        return code
    except CliError as exc:
        from tether.shared.text import printable

        print(printable(f"tether: {exc}" if not str(exc).startswith("tether") else str(exc)),
              file=sys.stderr)
        return exc.code
    except BrokenPipeError:
        # Whoever read our output went away (`tether list | head`): stop without a word, and
        # keep the interpreter's final flush from complaining about the pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:
        from tether.shared.errors import TetherError

        if isinstance(exc, TetherError):  # RemoteError included: the agent's own words
            from tether.shared.text import printable

            print(printable(f"tether: {exc.message}"), file=sys.stderr)
            return EXIT_ERROR
        raise


def entry() -> int:
    """The ``tether`` command: ``main``, then the process ends at once with its exit code, its
    output flushed. Interpreter finalization (tearing down every module and object) is ~5 ms of
    a command that took 25, and a client verb leaves nothing to it: no threads, no atexit
    handlers, no unflushed files; the kernel closes its sockets. A verb that may (the agent, a
    cluster's commands, ``top``), anything registered with atexit, a thread still running, an
    error while flushing: the normal way, as before. ``--help`` and ``--version`` leave by
    SystemExit, the normal way too."""
    code = main()
    import atexit  # built in: free

    if _finalize or atexit._ncallbacks() or _threads():
        return code
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # as the normal way would meet it, with its words
        return code
    os._exit(code)


def _threads() -> bool:
    """Is any thread but this one alive (it would be joined at a normal exit)?"""
    threading = sys.modules.get("threading")
    return threading is not None and threading.active_count() > 1


if __name__ == "__main__":
    sys.exit(entry())
