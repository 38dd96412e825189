"""A throwaway PostgreSQL server for tests, the cluster demo and the cluster benchmark.

Debian's server binaries (package ``postgresql``), a data directory and a Unix socket directory
in a fresh temporary directory, no TCP. PostgreSQL refuses to run as root, so as root the server
runs as the ``postgres`` user the package creates. ``cleanup()`` stops the server and removes
everything; it is safe to call more than once and after any failure.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

PORT = 5432


def server_bin() -> str:
    """The newest installed server's bin directory."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"),
                   key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    if not found:
        raise RuntimeError("no PostgreSQL server found in /usr/lib/postgresql/*/bin: install "
                           "the postgresql package (scripts/setup.sh does)")
    return os.path.dirname(found[-1])


class ScratchPostgres:
    def __init__(self) -> None:
        self.bin = server_bin()
        self.dir = tempfile.mkdtemp(dir="/tmp", prefix="ttpg")
        self.data = os.path.join(self.dir, "data")
        self.sock = os.path.join(self.dir, "sock")
        self.log = os.path.join(self.dir, "postgres.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.user: str | None = None
        kw: dict[str, Any] = {}
        if os.geteuid() == 0:
            self.user = "postgres"
            pw = pwd.getpwnam(self.user)
            os.chmod(self.dir, 0o755)
            for d in (self.data, self.sock):
                os.mkdir(d, 0o700)
                os.chown(d, pw.pw_uid, pw.pw_gid)
            open(self.log, "wb").close()
            os.chown(self.log, pw.pw_uid, pw.pw_gid)
            kw = {"user": self.user, "group": pw.pw_gid, "extra_groups": []}
        else:
            os.mkdir(self.sock, 0o700)
        self._kw = kw
        subprocess.run([os.path.join(self.bin, "initdb"), "-D", self.data, "--auth=trust",
                        "-U", "postgres", "--no-sync", "-E", "UTF8", "--locale=C"],
                       check=True, capture_output=True, cwd="/", **kw)
        # The superuser (the tests' administrator) by trust; every other role by its password,
        # as a site's pg_hba.conf would have it: a node's role proves itself.
        hba = os.path.join(self.data, "pg_hba.conf")
        with open(hba, "w") as f:
            f.write("local all postgres trust\nlocal all all scram-sha-256\n")

    def dsn(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@/{db}?host={self.sock}&port={PORT}"

    def start(self, timeout: float = 30.0) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [os.path.join(self.bin, "postgres"), "-D", self.data, "-p", str(PORT),
                 "-c", "listen_addresses=", "-c", f"unix_socket_directories={self.sock}",
                 "-c", "fsync=off", "-c", "max_connections=200"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd="/",
                start_new_session=True, **self._kw)
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}: "
                                   f"{self.tail()}")
            try:
                psycopg.connect(self.dsn(), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"postgres did not accept connections within {timeout}s:"
                                       f" {self.tail()}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Fast shutdown (clients are disconnected, committed work is kept)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def create_db(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.dsn(name)

    def drop_db(self, name: str) -> None:
        import psycopg

        if self.proc is None or self.proc.poll() is not None:
            return
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def drop_roles(self, *names: str) -> None:
        """Drop login and group roles (their databases dropped first: nothing left to own)."""
        import psycopg
        from psycopg import sql

        if self.proc is None or self.proc.poll() is not None:
            return
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            for name in names:
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))

    def cleanup(self) -> None:
        try:
            self.stop()
        finally:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.dir, ignore_errors=True)
