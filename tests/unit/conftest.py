"""What keeps tests/unit/ pure: while one of its tests runs, starting a process, opening a socket
or sending a signal raises at once, naming the call (an audit hook, PEP 578). Such a test
belongs in tests/integration/, where real processes and sockets are the point.

The hook is installed once per interpreter (audit hooks cannot be removed) and acts only while a
test of this directory runs, so the integration tests of the same session are not affected.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

_IMPURE = {
    "subprocess.Popen": "starts a process",
    "os.fork": "forks",
    "os.forkpty": "forks",
    "os.posix_spawn": "starts a process",
    "os.exec": "execs",
    "os.system": "starts a shell",
    "socket.__new__": "opens a socket",
    "os.kill": "sends a signal",
    "os.killpg": "sends a signal",
}
_active: list[str] = []


class Impure(RuntimeError):
    pass


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if _active and event in _IMPURE:
        raise Impure(f"{_active[-1]} {_IMPURE[event]} ({event}): tests/unit/ is pure; "
                     f"move it to tests/integration/")


sys.addaudithook(_hook)


@pytest.fixture(autouse=True)
def _pure(request: pytest.FixtureRequest) -> Iterator[None]:
    _active.append(request.node.nodeid)
    try:
        yield
    finally:
        _active.pop()
