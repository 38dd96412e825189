"""Entry point: ``python -m supervisor --run-dir DIR --lock-fd N`` (started by the agent only).

Everything the supervisor will ever need is imported here, before the step starts, so that a
package upgrade under a long-running supervisor cannot break it halfway through a job.

A supervisor forked from the template (template.py) enters at ``start``, with logging already
configured by the template: reading a command line or building a logging handler in every
forked supervisor would write to hundreds of the template's memory pages (reference counts,
caches), each of which then becomes a private copy of that supervisor's (bench/README.md,
memory).
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import resource  # noqa: F401  (os.wait4 imports it lazily for its rusage: load it now)
import sys

import prctl
import setproctitle

import tether
import tether.supervisor.handlers
import tether.supervisor.handover
import tether.supervisor.launch
import tether.supervisor.pmi
import tether.supervisor.pmi_io
import tether.supervisor.step  # noqa: F401  (eager import, see above)
from tether.shared import protocol, records
from tether.shared.paths import PathTooLong, RunDir, check_ipc_path
from tether.supervisor.service import Supervisor


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line of a cold start or a re-exec (the agent's spawn_cold.py, handover.py). A
    supervisor forked from the template has none: it enters at ``start``."""
    return _argparse(argv)


def _argparse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tether-supervisor")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--lock-fd", type=int, required=True)
    parser.add_argument("--resume-fd", type=int,
                        help="re-executed by itself: the state its previous image handed over")
    parser.add_argument("--ready-fd", type=int, default=-1,
                        help="pipe to write one byte to once the socket is bound")
    parser.add_argument("--warm", action="store_true",
                        help="forked from the supervisor template (said in the log)")
    return parser.parse_args(argv)


class LogFormatter(logging.Formatter):
    """Every line names the supervisor that wrote it (``who``: its pid and step, set once it
    knows them), so that one formatter serves every supervisor the template forks."""

    who = "supervisor"

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(who)s %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.who = self.who
        return super().format(record)


_formatter: LogFormatter | None = None


def configure_logging() -> LogFormatter:
    """The root logger writes INFO and up to stderr (once per process: the template does it
    before it forks, for all its supervisors). Records skip what the format never shows: the
    caller's file and line (a frame walk per record), thread and process names."""
    global _formatter
    if _formatter is None:
        logging._srcfile = None  # documented: no sys._getframe() walk per record
        logging.logThreads = False
        logging.logProcesses = False
        logging.logMultiprocessing = False
        _formatter = LogFormatter()
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_formatter)
        root = logging.getLogger()
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    return _formatter


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--handover-formats"]:
        # asked by a running supervisor before it re-executes into this build (handover.py)
        formats = ",".join(str(f) for f in sorted(tether.supervisor.handover.FORMATS_READ))
        print(f"formats {formats} {tether.__version__}")
        return 0
    args = parse_args(argv)
    return start(args.run_dir, args.lock_fd, ready_fd=args.ready_fd, resume_fd=args.resume_fd,
                 warm=args.warm)


def start(run_dir: str, lock_fd: int, *, ready_fd: int = -1, resume_fd: int | None = None,
          warm: bool = False) -> int:
    """The supervisor, from its parsed command line on (the template calls this directly)."""
    name = os.path.basename(os.path.normpath(run_dir))
    try:
        job_s, attempt_s = name.split(".")
        rd = RunDir(os.path.abspath(run_dir), int(job_s), int(attempt_s))
    except ValueError:
        print(f"tether-supervisor: {run_dir}: not a run directory", file=sys.stderr)
        return 2
    configure_logging().who = f"supervisor[{os.getpid()}] job={rd.job}.{rd.attempt}"
    log = logging.getLogger("tether.supervisor")
    try:
        # The agent took this lock before spawning us and handed us the fd; re-taking it on
        # the same open file is a no-op that proves we really hold it.
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.set_inheritable(lock_fd, False)
        if ready_fd >= 0:
            os.set_inheritable(ready_fd, False)
        held, on_disk = os.fstat(lock_fd), os.stat(rd.lock, follow_symlinks=False)
    except OSError as exc:
        log.error("run directory lock (fd %d) is not ours: %s", lock_fd, exc)
        return 2
    if (held.st_dev, held.st_ino) != (on_disk.st_dev, on_disk.st_ino):
        # A spawn the agent gave up on and redid: that attempt's run directory was made anew,
        # and its own supervisor owns the socket.
        log.error("the lock we were handed is no longer %s; not starting", rd.lock)
        return 2
    try:
        spec = records.read_spec(rd.spec)
    except (OSError, records.RecordError) as exc:
        log.error("cannot read the job spec: %s", exc)
        return 2
    try:
        check_ipc_path(rd.sock)
    except PathTooLong as exc:
        log.error("%s", exc)
        return 2
    # The run dir in the title tells operators (and tests) which agent's spool it belongs to.
    setproctitle.setproctitle(
        f"tether-supervisor job={rd.job} attempt={rd.attempt} dir={rd.path}")
    prctl.set_child_subreaper(1)
    protocol.load_codec()  # msgpack now: protocol.py imports it at first use
    if os.environ.get("TETHER_AUDIT_IMPORTS"):  # listed in shared/faults.py
        # Tests prove the claim above: any module loaded from here on is reported.
        def audit(event: str, details: tuple[object, ...]) -> None:
            if event == "import":
                log.error("late import of %s after start-up", details[0])
        sys.addaudithook(audit)
    sup = Supervisor(rd, spec, lock_fd, ready_fd)
    sup.start_kind = "warm" if warm else "cold"
    if resume_fd is not None:
        try:
            state = tether.supervisor.handover.read_state(resume_fd)
        except Exception as exc:  # nothing to serve from: the lock's release tells the agent
            log.critical("cannot take over the handed-over state: %s", exc)
            return 2
        sup.restore(state, upgraded_from=str(state.get("from", "?")))
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
