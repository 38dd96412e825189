"""The warm supervisor template: ``python -I -m tether.supervisor.template --socket PATH``.

Theory of operation. A cold supervisor spends ~85 ms starting Python and importing; this process
pays that once. It imports everything a supervisor ever loads (pyzmq among them: the agent's
ROUTER, ctl.py), configures the supervisors' logging, creates no ZeroMQ context (each supervisor
makes its own after the fork, with libzmq's two threads) and no thread, moves every object it
made into the permanent GC generation (``gc.freeze``: the collector then never writes to those
pages, so forked children keep sharing them), and waits on a ``SOCK_SEQPACKET`` socket only its
own uid can use (0600 file, ``SO_PEERCRED`` checked). For each spawn request (the run directory,
the supervisor's environment and umask; the run-dir lock, ``supervisors.log`` and the ready pipe
as SCM_RIGHTS fds) it forks the supervisor as its *child* with ``os.fork`` (the interpreter's
own fork protocol, its at-fork hooks included), and the child starts a session of its own
(``setsid``: it leads it, as systemd's services and containerd's shims lead theirs; it opens no
terminal). The template replies with the child's pid and never waits for it: this process
ignores SIGCHLD, so the kernel reaps its supervisors as they exit (each sets SIGCHLD back to its
default at once, before anything else), and when the template leaves first they are re-parented
to its parent (init or the nearest subreaper: the template itself was started detached), the
parent a cold supervisor has. Not a double fork (the supervisor re-parented at once, as the cold
path's shell does it): its middle child made every warm spawn ~6 ms slower on this 2-core
machine under load; and not, as before issue 26, a raw ``clone(CLONE_PARENT)`` through ctypes
around CPython's fork hooks (bench/README.md, "Public mechanisms only").

What a supervisor must not inherit from here, and how it is prevented (``become_supervisor``):
- fds: every fd but stdin (/dev/null), stdout and stderr (the log), the lock and the ready pipe
  is closed, the template's socket and the request's connection included;
- locks: the template has one thread, so no lock can be held by another thread at fork time;
- threads: none exist to be lost (the fork-safety test checks ``Threads: 1``);
- random state: ``random`` is reseeded from the kernel, and so is libc's ``rand()`` (no library
  of a supervisor's seeds it: each gets a distinct, unguessable sequence, not glibc's default);
- at-fork hooks: those of the standard modules run as ``os.fork`` runs them (threading's and
  logging's re-make their locks; random's reseeds, and so does ``after_fork``);
- environment, umask, cwd: set from the request and ``/``; signal dispositions: this process
  resets them to the defaults once, at its start, and never handles a signal itself (SIGCHLD,
  which it ignores, is set back to its default in the child).

Memory. What a supervisor shares with this process is whatever it never writes to; CPython
writes to every object it touches (reference counts), so each page a forked supervisor touches
becomes a private copy of its own. This process therefore does, once and before it forks, what
every supervisor would otherwise do for itself (argument parsing is skipped: ``entry.start``;
logging is configured here), then collects and moves everything into the permanent generation
(``gc.freeze``), with public mechanisms only: no CPython internals, no ctypes around them.
What an idle supervisor then holds of its own, and what the mechanisms this replaced saved
(little: the heap as a file 0.66-0.96 MiB on 3.11-3.14, the emptied at-fork lists 0.11 on
3.11), is in bench/README.md ("Public mechanisms only").

Same-page merging (``agent --ksm``, off by default: docs/operations.md). Most of the pages a
supervisor copies end up byte-identical to another supervisor's (the same reference counts
written in the same objects). With ``--ksm`` this process marks nothing itself (a mark on its
mappings would be inherited, and ksmd would read every page its forks still share with it):
it tells its forks to mark their own copies once their step runs (ksm.py). Not
``PR_SET_MEMORY_MERGE``: that marks the whole address space and survives exec (seen on 6.18),
so every task of every user would be mergeable too, a side channel into their memory and
ksmd's work on all of it; a mark on mappings ends with the task's exec.

Running supervisors never depend on the template: they share nothing with it after the fork.
The template leaves when asked (an agent of another code identity replaces it; an agent stopped
with ``--stop-for-good`` asks it to ``stop``), when its socket path no longer names its socket
(the state directory was removed), and when no agent has run for the linger its agent gave it
(``agent --template-linger``): checked while idle, template_watch.py.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import logging
import os
import random
import select
import signal
import socket
import sys

import setproctitle

import tether.supervisor.__main__ as entry
import tether.supervisor.pmi_io  # noqa: F401  (everything a supervisor may load, loaded now)
from tether.shared import procid, template_wire
from tether.shared.template_wire import TemplateError
from tether.supervisor import ksm
from tether.supervisor.service import reset_signal_dispositions
from tether.supervisor.template_watch import AgentWatch, serve_until_leaving

log = logging.getLogger("tether.template")

#: A request must arrive whole within this long after the connection is accepted.
REQUEST_TIMEOUT = 2.0
#: Exit status of a forked supervisor that failed before its own ``main`` could report.
EXIT_SETUP_FAILED = 70

# libc's symbols, as the interpreter links them: not ctypes.util, which imports shutil and
# tempfile (and with them bz2, lzma and their libraries: mappings every fork copies)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.srand.argtypes = [ctypes.c_uint]
_libc.srand.restype = None

#: this process's environment when it began to serve: what a supervisor's differs by is all it
#: changes of ``os.environ`` (rebuilding the whole mapping touches every entry)
_environ: dict[str, str] = {}


def _formatter(prog: str) -> argparse.HelpFormatter:
    # a width of its own: argparse's default asks shutil for the terminal's, and shutil
    # imports bz2 and lzma (their libraries mapped here: mappings every fork copies)
    return argparse.HelpFormatter(prog, width=80)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tether-template", formatter_class=_formatter)
    p.add_argument("--socket", required=True)
    p.add_argument("--ksm", action="store_true",
                   help="its supervisors mark their own copies mergeable (agent --ksm)")
    p.add_argument("--agent-lock", help="the agent's lock file, to see whether an agent runs")
    p.add_argument("--linger", type=float, help="leave once no agent ran for this long")
    args = p.parse_args(argv)
    watch = AgentWatch(args.agent_lock, args.linger)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s template[{os.getpid()}] %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    # The detaching shell started us as a background job: SIGINT and SIGQUIT arrive ignored,
    # and ignored signals would be every supervisor's (and their tasks') too.
    reset_signal_dispositions()
    # Python's own SIGINT handler too, where it was installed (a template not started as a
    # background job): this process handles no signal
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    # Its supervisors are its children, and it never waits for them: the kernel reaps them
    # (each sets SIGCHLD back to its default at once)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    entry.configure_logging()  # the supervisors' root logger; each one only names itself
    identity = template_wire.template_identity(args.ksm)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)
    old = os.umask(0o077)
    try:
        sock.bind(args.socket)
    finally:
        os.umask(old)
    sock.listen(1024)  # a burst of submits queues here, answered in order
    inode = os.stat(args.socket).st_ino
    setproctitle.setproctitle(f"tether-template dir={os.path.dirname(args.socket)}")
    global _environ
    _environ = dict(os.environ)
    # Read once here and cached: every supervisor's identity needs it, and a first text-mode
    # open in each (the io and codecs machinery run for the first time) copied ~50 kB more of
    # this process's pages into it (bench/README.md). A reboot ends this process anyway.
    procid.boot_id()
    if args.ksm:
        ksm.ENABLED = True  # each supervisor marks its own copies once its step runs (ksm.py)
    gc.collect()
    gc.freeze()  # from here on the collector leaves the imported world's pages alone
    log.info("supervisor template %s ready on %s", identity, args.socket)
    sys.stderr.flush()
    return serve_until_leaving(
        sock, args.socket, inode, watch, lambda conn: serve(conn, identity, watch))


def serve(conn: socket.socket, identity: str, watch: AgentWatch | None = None) -> str:
    """Answer one request; return its op."""
    conn.settimeout(REQUEST_TIMEOUT)
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    uid = int.from_bytes(creds[4:8], sys.byteorder)
    if uid != os.getuid():
        log.warning("refused a connection from uid %d", uid)
        return "refused"
    data, fds, _, _ = socket.recv_fds(conn, template_wire.MAX_MESSAGE, template_wire.SPAWN_FDS)
    try:
        try:
            req = template_wire.decode(data)
        except TemplateError as exc:
            _reply(conn, {"ok": False, "error": str(exc)})
            return "bad"
        op = req.get("op")
        if op == "hello":
            if watch is not None:  # a kept template takes the linger of the agent keeping it
                watch.configure(req.get("agent_lock"), req.get("linger"))
            _reply(conn, {"ok": True, "identity": identity, "pid": os.getpid()})
        elif op == "stop":
            _reply(conn, {"ok": True})
        elif op == "exit":
            if req.get("identity") == identity:
                _reply(conn, {"ok": False, "error": "this template runs that very code"})
                return "bad"
            _reply(conn, {"ok": True})
        elif op == "spawn":
            try:
                run_dir, env, umask = template_wire.check_spawn(req)
                if len(fds) != template_wire.SPAWN_FDS:
                    raise TemplateError(f"spawn needs {template_wire.SPAWN_FDS} fds, "
                                        f"got {len(fds)}")
                if _peer_gone(conn):
                    # The agent gave up waiting and will start this run directory cold: a
                    # supervisor forked now would compete with that one for its socket.
                    raise TemplateError("the agent closed the connection before the fork")
                pid = fork_supervisor(run_dir, env, umask, fds)
            except (TemplateError, OSError) as exc:
                log.warning("spawn for %s refused: %s", req.get("run_dir"), exc)
                _reply(conn, {"ok": False, "error": str(exc)})
            else:
                _reply(conn, {"ok": True, "pid": pid})
        else:
            _reply(conn, {"ok": False, "error": f"unknown op {op!r}"})
        return str(op)
    finally:
        for fd in fds:
            os.close(fd)


def _reply(conn: socket.socket, obj: dict[str, object]) -> None:
    with contextlib.suppress(OSError):  # the agent gave up: it decides from the lock
        conn.send(template_wire.encode(obj))


def _peer_gone(conn: socket.socket) -> bool:
    poller = select.poll()
    poller.register(conn, select.POLLIN | select.POLLRDHUP)
    return any(ev & (select.POLLHUP | select.POLLRDHUP | select.POLLERR)
               for _, ev in poller.poll(0))


def fork_supervisor(run_dir: str, env: dict[str, str], umask: int, fds: list[int]) -> int:
    """Fork the supervisor (see the module's docstring); its pid."""
    lock_fd, log_fd, ready_fd = fds
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (runs in the child)
        try:
            # this process's SIGCHLD is ignored (no zombies of its own); the supervisor
            # reaps its tasks
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
        except OSError:
            os._exit(EXIT_SETUP_FAILED)
        become_supervisor(run_dir, env, umask, lock_fd, log_fd, ready_fd)
    return pid


def become_supervisor(run_dir: str, env: dict[str, str], umask: int, lock_fd: int,
                      log_fd: int, ready_fd: int) -> None:
    """In the forked supervisor: shed what belongs to the template, then run the step."""
    rc = EXIT_SETUP_FAILED
    try:
        after_fork(keep=(lock_fd, ready_fd), log_fd=log_fd)
        os.chdir("/")
        os.umask(umask)
        for key in _environ.keys() - env.keys():
            del os.environ[key]
        for key, value in env.items():
            if _environ.get(key) != value:
                os.environ[key] = value
        rc = entry.start(run_dir, lock_fd, ready_fd=ready_fd, warm=True)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else EXIT_SETUP_FAILED
    except BaseException:
        with contextlib.suppress(Exception):
            logging.getLogger("tether.supervisor").exception("forked supervisor failed")
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(rc)


def after_fork(*, keep: tuple[int, ...], log_fd: int) -> None:
    """Make a fresh process of a forked template child (see the module's docstring)."""
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    # every other fd goes: the template's socket, the request's connection, the log's dup
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))
    for fd in keep:
        os.set_inheritable(fd, False)
    random.seed()  # (its own at-fork hook does too; this is the promise, in one place)
    _libc.srand(int.from_bytes(os.urandom(4), sys.byteorder))
    log.handlers.clear()  # the supervisor logs through the root logger, set up by its main


if __name__ == "__main__":
    sys.exit(main())
