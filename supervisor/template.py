"""The warm supervisor template: ``python -I -m tether.supervisor.template --socket PATH``.

Theory of operation. A cold supervisor spends ~85 ms starting Python and importing; this process
pays that once. It imports everything a supervisor ever loads (pyzmq among them: the agent's
ROUTER, ctl.py), configures the supervisors' logging, creates no ZeroMQ context (each supervisor
makes its own after the fork, with libzmq's two threads) and no thread, moves every object it made
into the permanent GC generation (``gc.freeze``: the collector then never writes to those pages, so
forked children keep sharing them), and waits on a ``SOCK_SEQPACKET`` socket only its own uid can
use (0600 file, ``SO_PEERCRED`` checked). For each spawn request (the run directory, the
supervisor's environment and umask; the run-dir lock, ``supervisors.log`` and the ready pipe as
SCM_RIGHTS fds) it forks the supervisor as its *sibling*: ``clone(CLONE_PARENT)`` makes the child's
parent this process's parent (init or the nearest subreaper: the template itself was started
detached), exactly the parent a double fork would leave it with once the middle child exited, and
the child starts a session of its own (``setsid``: it leads it, as systemd's services and
containerd's shims lead theirs; it opens no terminal). The template replies with the child's pid
and never waits for it: not its child. Why not the double fork the cold path's shell does: the
middle child cost a job ~3.7 ms of CPU (a second copy of the page tables, their teardown at its
exit, and the copy-on-write faults of its Python at-fork work; bench/README.md), a quarter of the
template's share of a job. Where the kernel refuses ``CLONE_PARENT`` (this process is a namespace's
init), a seccomp policy does, or the architecture's clone number is unknown here, the template
forks twice instead, as it did before, and says so once.

``clone`` is called through ``syscall`` with the interpreter's own fork protocol around it
(``PyOS_BeforeFork``, ``PyOS_AfterFork_Child``/``_Parent``: what ``os.fork`` does around ``fork``),
with the GIL held as ``os.fork`` holds it. What libc's ``fork`` adds, and why a single-threaded
process without it is sound: its ``pthread_atfork`` handlers (none: of the shared objects this
process maps, none imports ``pthread_atfork`` or ``__register_atfork``, by ``nm -D``, pyzmq's
libzmq and libsodium included; no supervisor module imports hashlib or shutil, so neither
libcrypto, libbz2 nor liblzma is mapped: tests/test_template.py), its malloc and stdio locks (taken
only when other threads exist: there are none), the robust-mutex list (none used) and the cached
thread id in the child's thread descriptor (left at the template's; glibc reads it only for another
thread's signals and for robust or priority-inheriting mutexes: ``raise`` and ``pthread_kill`` of
oneself ask the kernel for the id since glibc 2.34, because a ``vfork`` child has the same stale
id).

What a supervisor must not inherit from here, and how it is prevented (``become_supervisor``):
- fds: every fd but stdin (/dev/null), stdout and stderr (the log), the lock and the ready pipe
  is closed, the template's socket and the request's connection included;
- locks: the template has one thread, so no lock can be held by another thread at fork time;
- threads: none exist to be lost (the fork-safety test checks ``Threads: 1``);
- random state: ``random`` is reseeded from the kernel, and so is libc's ``rand()`` (no library
  of a supervisor's seeds it: each gets a distinct, unguessable sequence, not glibc's default);
- at-fork hooks: none run (atfork.py: the template empties the interpreter's lists; with one
  thread, threading's and logging's have nothing to re-make, and random is reseeded above);
- environment, umask, cwd: set from the request and ``/``; signal dispositions: this process
  resets them to the defaults once, at its start, and never handles a signal itself.

Memory. What a supervisor shares with this process is whatever it never writes to; CPython 3.11
writes to every object it touches (reference counts), so each page a forked supervisor touches
becomes a private copy of its own. This process therefore does, once and before it forks, what
every supervisor would otherwise do for itself (argument parsing is skipped: ``entry.start``;
logging is configured here), packs the code objects supervisors run onto few pages
(hotcode.py), fills the partly used pools of CPython's small-object allocator so that a
child's first allocations do not land in holes all over the template's pages (poolfill.py),
empties CPython's type attribute cache, then fills it with what supervisors look up
(typecache.py): a child's cache misses would otherwise each write to the looked-up name's
page, and an eviction to the evicted name's, at random across the whole heap; and empties the
interpreter's at-fork hook lists (atfork.py): run for the first time in every child, the hooks
of threading, logging and random wrote to ~140 of this process's pages in each. Last, it turns
its heap into a file (heapfile.py): a supervisor whose step runs gives back its copies of the
pages that equal the template's again, about a third of them (bench/README.md has the figures).

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
import errno
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
from tether.shared import faults, procid, template_wire
from tether.shared.template_wire import TemplateError
from tether.supervisor import atfork, heapfile, hotcode, hotcode_list, ksm, poolfill, typecache
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

#: libc's ``syscall`` called with the GIL held (a ``PyDLL``), as ``os.fork`` calls ``fork``
_syscall = ctypes.PyDLL(None, use_errno=True).syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.c_ulong]
#: how the kernel, or a seccomp policy, refuses ``CLONE_PARENT`` where a fork would work
_CLONE_REFUSED = frozenset((errno.EINVAL, errno.EPERM, errno.ENOSYS))
#: clone's number; its first two arguments (flags, stack) are the same on both
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine)
_CLONE_PARENT = 0x00008000
_pyapi = ctypes.pythonapi
for _name in ("PyOS_BeforeFork", "PyOS_AfterFork_Parent", "PyOS_AfterFork_Child"):
    getattr(_pyapi, _name).argtypes = []
    getattr(_pyapi, _name).restype = None

#: fork each supervisor twice (where ``clone_sibling`` is refused; and a test fault)
FORK_TWICE = False

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
    global FORK_TWICE
    FORK_TWICE = faults.agent_fault(faults.agent_faults(), "template-forks-twice")
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
    # background job): this process handles no signal, so nothing writes to its memory but
    # its one thread (heapfile.py depends on that while its heap becomes a file)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
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
    packed = hotcode.pack(hotcode_list.HOT)
    lookups = typecache.prepare(hotcode_list.LOOKUPS)
    hooks = atfork.empty()
    if hooks < 0:
        log.warning("cannot tell the interpreter's at-fork hook lists apart; every supervisor "
                    "runs the hooks (more of this process's memory copied into each)")
    gc.collect()
    filled = poolfill.fill()  # (see the module's docstring: Memory)
    sys._clear_type_cache()
    warmed = typecache.warm(lookups)
    if args.ksm:
        ksm.ENABLED = True  # each supervisor marks its own copies once its step runs (ksm.py)
    gc.freeze()  # from here on the collector leaves the imported world's pages alone
    # the last change to this process's memory before it serves: its heap becomes a file
    if faults.agent_fault(faults.agent_faults(), "no-heapfile"):
        heap = "the heap stays anonymous (fault no-heapfile)"
    else:
        heap = heapfile.snapshot()
    log.info("supervisor template %s ready on %s (%d functions' code packed, %d pool holes "
             "filled, %d of %d type lookups made, %d at-fork hooks emptied; %s)", identity,
             args.socket, packed, filled, warmed, len(hotcode_list.LOOKUPS), max(hooks, 0), heap)
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
    """Fork the supervisor as this process's sibling (see the module's docstring); its pid."""
    lock_fd, log_fd, ready_fd = fds
    sys.stderr.flush()
    global FORK_TWICE
    if not FORK_TWICE:
        try:
            pid = clone_sibling()
        except OSError as exc:
            if exc.errno not in _CLONE_REFUSED:
                raise  # EAGAIN, ENOMEM: a fork would fail the same way
            log.warning("%s: forking each supervisor twice instead", exc)
            FORK_TWICE = True
        else:
            if pid == 0:  # pragma: no cover (runs in the child)
                try:
                    os.setsid()
                except OSError:
                    os._exit(EXIT_SETUP_FAILED)
                become_supervisor(run_dir, env, umask, lock_fd, log_fd, ready_fd)
            return pid
    return _fork_twice(run_dir, env, umask, fds)


def clone_sibling() -> int:
    """``os.fork``, but the child's parent is this process's parent (``CLONE_PARENT``): 0 in the
    child, its pid here. EINVAL where the kernel refuses (this process is an init) or this
    machine's clone number is not known here; EPERM or ENOSYS where a seccomp policy does."""
    if _SYS_CLONE is None:
        raise OSError(errno.EINVAL, f"clone's system call number on {os.uname().machine}")
    _pyapi.PyOS_BeforeFork()
    pid = _syscall(_SYS_CLONE, _CLONE_PARENT | signal.SIGCHLD, None, None, None, 0)
    if pid == 0:  # pragma: no cover (runs in the child)
        _pyapi.PyOS_AfterFork_Child()
        return 0
    err = ctypes.get_errno()
    _pyapi.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(err, f"clone(CLONE_PARENT): {os.strerror(err)}")
    return int(pid)


def _fork_twice(run_dir: str, env: dict[str, str], umask: int, fds: list[int]) -> int:
    """The supervisor as a grandchild whose parent exits at once: re-parented away."""
    lock_fd, log_fd, ready_fd = fds
    r, w = os.pipe()
    first = os.fork()
    if first == 0:  # pragma: no cover (runs in the child)
        try:
            os.close(r)
            os.setsid()
            pid = os.fork()
            if pid == 0:
                os.close(w)
                become_supervisor(run_dir, env, umask, lock_fd, log_fd, ready_fd)
            os.write(w, str(pid).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        data = os.read(r, 32)
    finally:
        os.close(r)
        os.waitpid(first, 0)
    if not data:
        raise TemplateError("the intermediate child exited before it forked the supervisor")
    return int(data)


def become_supervisor(run_dir: str, env: dict[str, str], umask: int, lock_fd: int,
                      log_fd: int, ready_fd: int) -> None:
    """In the forked supervisor: shed what belongs to the template, then run the step."""
    rc = EXIT_SETUP_FAILED
    record_to = env.get(hotcode.RECORD)
    if record_to:
        hotcode.record()
    lookups_to = env.get(typecache.RECORD)
    if lookups_to:
        typecache.locate()  # now: finding the cache looks things up too
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
        if lookups_to:
            with contextlib.suppress(Exception):
                typecache.write_record(lookups_to)  # first: the cache as the step left it
        if record_to:
            with contextlib.suppress(Exception):
                hotcode.write_record(record_to)
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
