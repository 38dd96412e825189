"""One node asking another's step for a user, through the database (I/O: threads of its own).

``inspect``, ``attach``, ``signal``, ``suspend`` and ``resume`` of a cluster job work from any
node. The nodes have one authenticated channel between them already, the database, and no other:
no node listens on the network for another (a port a root daemon serves to the network is a port
every local user reaches too). So the asking agent, having authenticated its user (the kernel)
and checked that she owns the job (or is root), writes an *ask* (``tether_ask``: the job, the
verb, its arguments, her uid; checked again there against the job's owner); the job's node is
woken (NOTIFY ``tether_ask``), takes it (``tether_asked``), puts it to the step's supervisor over
its local socket (or to itself, for suspend and resume), and writes the answer
(``tether_answer``, NOTIFY ``tether_answer``), which the asker reads once (``tether_answer_of``).

Bounds: a node has at most 64 asks waiting (the database refuses more, ``busy``); the serving
side runs at most ``SERVERS`` at once and caps a long poll's hold at ``MAX_HOLD`` seconds (an
``attach`` asks again, from the offsets it reached); an answer is at most 2 MiB. Bytes (a step's
output) travel base64-encoded (``pack``/``unpack``). Asks nobody read are deleted after ten
minutes.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from tether.shared import cluster_db
from tether.shared.client import Client
from tether.shared.cluster_sql import CHANNEL_ANSWER
from tether.shared.errors import RemoteError, TetherError, Unavailable

log = logging.getLogger("tether.agent.cluster")

#: asks served at once on this node
SERVERS = 4
#: the longest a served long poll waits (an attach asks again)
MAX_HOLD = 5.0
#: how long the asker waits for the answer, beyond the ask's own hold
ANSWER_WAIT = 15.0


def pack(value: Any) -> Any:
    """JSON-able: bytes become {"$b": base64}."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$b": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        return {str(k): pack(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [pack(v) for v in value]
    return value


def unpack(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$b"} and isinstance(value["$b"], str):
            return base64.b64decode(value["$b"])
        return {k: unpack(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unpack(v) for v in value]
    return value


class RelayServer:
    """This node's side: serve the asks other nodes put to its steps."""

    def __init__(self, dsn: str, state_dir: str, agent_sock: str) -> None:
        self.dsn = dsn
        self.state_dir = state_dir
        self.agent_sock = agent_sock
        self.pool = ThreadPoolExecutor(max_workers=SERVERS, thread_name_prefix="tether-relay")
        self.lock = threading.Lock()  # the connection: one statement at a time
        self.conn: cluster_db.Conn | None = None
        self.fetching = threading.Event()

    def wake(self) -> None:
        """Asks are waiting (NOTIFY, or a pass's look): take them, off the loop."""
        if not self.fetching.is_set():
            self.fetching.set()
            self.pool.submit(self.fetch)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            if self.conn is not None:
                self.conn.close()
                self.conn = None

    def _db(self) -> cluster_db.Conn:
        if self.conn is None or self.conn.closed:
            self.conn = cluster_db.open_checked(self.dsn, application="tether agent relay")
        return self.conn

    def fetch(self) -> None:
        try:
            self.fetching.clear()
            with self.lock:
                rows = self._db().execute("SELECT tether_asked() AS a").fetchall()
            for row in rows:
                self.pool.submit(self.serve, row["a"])
        except (psycopg.Error, TetherError) as exc:
            log.warning("cannot take other nodes' asks: %s", exc)
            with self.lock:
                if self.conn is not None:
                    self.conn.close()
                    self.conn = None

    def serve(self, ask: dict[str, Any]) -> None:
        try:
            answer: dict[str, Any] = {"ok": pack(self.execute(ask))}
        except RemoteError as exc:
            answer = {"error": {"code": exc.code, "message": exc.message}}
        except TetherError as exc:
            answer = {"error": {"code": exc.code, "message": exc.message}}
        except Exception as exc:  # noqa: BLE001 - answered, and logged: never the daemon's end
            log.exception("serving node %s's ask %s", ask.get("from"), ask.get("id"))
            answer = {"error": {"code": "internal", "message": f"internal error: {exc}"}}
        try:
            with self.lock:
                self._db().execute("SELECT tether_answer(%s, %s)", (ask["id"], Jsonb(answer)))
        except psycopg.Error as exc:
            log.warning("cannot answer node %s's ask %s: %s", ask.get("from"), ask.get("id"),
                        exc)

    def execute(self, ask: dict[str, Any]) -> Any:
        """Put the ask to the step (as root: the database checked who asks, tether_ask)."""
        kind, args = str(ask["kind"]), dict(ask["args"])
        if "hold" in args:
            args["hold"] = min(float(args["hold"]), MAX_HOLD)
        if kind in ("suspend", "resume"):  # the agent's verbs: to this node's own door
            client = Client(self.agent_sock, timeout=10.0)
            try:
                return client.call(kind, {"job": int(ask["job"])}, timeout=10.0)
            finally:
                client.close()
        from tether.shared.step_client import connect

        step = connect(int(ask["local_job"]), state_dir=self.state_dir, timeout=5.0)
        try:
            if kind == "hello":
                return step.hello
            return step.call(kind, args, timeout=float(args.get("hold", 0)) + 5.0)
        finally:
            step.close()


def ask(dsn: str, job: int, uid: int, kind: str, args: dict[str, Any]) -> Any:
    """The asker's side, on a thread of its own (it waits): ask, wait for the answer, read it.
    Returns the step's result, or raises its error as a TetherError."""
    conn = cluster_db.open_checked(dsn, application="tether agent ask")
    try:
        cluster_db.listen(conn, CHANNEL_ANSWER)
        ask_id = int(cluster_db.call(conn, "SELECT tether_ask(%s, %s, %s, %s)",
                                     (job, uid, kind, Jsonb(args))))
        deadline = time.monotonic() + float(args.get("hold", 0)) + ANSWER_WAIT
        while True:
            answer = cluster_db.call(conn, "SELECT tether_answer_of(%s)", (ask_id,))
            if answer is not None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(f"job {job}: its node did not answer {kind!r} within "
                                  f"{ANSWER_WAIT + float(args.get('hold', 0)):g}s")
            for _ in conn.notifies(timeout=min(left, 1.0), stop_after=1):
                pass  # any answer wakes us: ours is read above
    finally:
        conn.close()
    if "error" in answer:
        err = answer["error"]
        raise RemoteError(str(err.get("code", "internal")), str(err.get("message", "")))
    return unpack(answer.get("ok"))

