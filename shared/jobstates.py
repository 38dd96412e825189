"""A job's states and the moves between them: one table, for a node and for the cluster. Pure.

A node's agent moves its jobs through these states in SQLite (``agent/job.py`` takes its state
names from here; the attempt's own machine, ``agent/lifecycle.py``, decides when); the cluster
moves its jobs through the same states in PostgreSQL, and the guards of the functions that do it
(``shared/cluster_funcs.py``) are written from this table, not beside it: a move is allowed
from exactly the states ``MOVES`` lists. ``tests/integration/test_jobstates.py`` checks the table's
invariants and, on a real PostgreSQL, that each function allows a move from those states and
refuses it from every other.

    pending --claim--> starting --start--> running --end--> completed | failed | cancelled
       |                  |                   |                      | timeout
       |                  +------ requeue ----+--> pending   (the attempt was lost: run again)
       |                  +------ lose -------+--> node_fail (lost, not to be run again)
       +--cancel / never (dependency) --> cancelled;  +--invalid--> failed

``lost`` is a node's own verdict on a step it cannot account for (``agent/lifecycle.py``);
``node_fail`` the cluster's on a job whose node was lost.
"""

from __future__ import annotations

import enum

PENDING = "pending"
ACTIVE = ("starting", "running")
#: the final states: no move leaves them
FINAL = ("completed", "failed", "cancelled", "lost", "timeout", "node_fail")
STATES = (PENDING, *ACTIVE, *FINAL)
#: the ends a step reports for itself (its result)
RESULTS = ("completed", "failed", "cancelled", "lost", "timeout")


class Move(enum.Enum):
    CLAIM = "claim"          # a node takes it (its attempt + 1)
    START = "start"          # its supervisor launched the tasks
    END = "end"              # the step's result (one of RESULTS)
    REQUEUE = "requeue"      # the attempt was lost (its node, or never recorded): run again
    LOSE = "lose"            # the attempt was lost and the job is not to be run again
    CANCEL = "cancel"        # cancelled while queued (an active one is asked of its node)
    ASK_CANCEL = "ask_cancel"  # a cancel asked of an active job's node
    NEVER = "never"          # a dependency that can never hold
    INVALID = "invalid"      # a row no node can run
    HOLD = "hold"            # held or released: stays queued


#: move -> (the states it may start from, where it leads; None: it stays, or RESULTS)
MOVES: dict[Move, tuple[tuple[str, ...], str | None]] = {
    Move.CLAIM: ((PENDING,), "starting"),
    Move.START: (("starting",), "running"),
    Move.END: (ACTIVE, None),
    Move.REQUEUE: (ACTIVE, PENDING),
    Move.LOSE: (ACTIVE, "node_fail"),
    Move.CANCEL: ((PENDING,), "cancelled"),
    Move.ASK_CANCEL: (ACTIVE, None),
    Move.NEVER: ((PENDING,), "cancelled"),
    Move.INVALID: ((PENDING,), "failed"),
    Move.HOLD: ((PENDING,), None),
}


class MoveError(Exception):
    """A move the table does not allow from the job's state."""


def sources(move: Move) -> tuple[str, ...]:
    return MOVES[move][0]


def after(move: Move, state: str, result: str | None = None) -> str:
    """The state ``move`` leads a job in ``state`` to; MoveError if it may not."""
    allowed, to = MOVES[move]
    if state not in allowed:
        raise MoveError(f"can't {move.value} a job that is {state}")
    if move is Move.END:
        if result not in RESULTS:
            raise MoveError(f"a step's result is one of {', '.join(RESULTS)}, not {result}")
        return result
    return state if to is None else to


def sql_list(states: tuple[str, ...]) -> str:
    """``('a', 'b')``: the states as an SQL list (names of this module's, never input)."""
    return "(" + ", ".join(f"'{s}'" for s in states) + ")"
