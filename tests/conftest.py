from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import Node

#: the cluster's fixtures (``pg``, ``cluster``) for every test module that asks for them
pytest_plugins = ["tests.clusterkit"]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash.setdefault(_FAILED, False)
        if report.failed:
            item.stash[_FAILED] = True
    return report


_FAILED = pytest.StashKey[bool]()


def _finish(request: pytest.FixtureRequest, nodes: list[Node]) -> None:
    failed = request.node.stash.get(_FAILED, False)
    for n in nodes:
        if failed:  # the agent's and supervisors' own account, for whoever reads the failure
            print(n.logs())
        n.cleanup()


@pytest.fixture
def node(request: pytest.FixtureRequest) -> Iterator[Node]:
    n = Node()
    try:
        yield n
    finally:
        _finish(request, [n])


@pytest.fixture
def make_node(request: pytest.FixtureRequest) -> Iterator[Any]:
    made: list[Node] = []

    def factory(**kw: Any) -> Node:
        n = Node(**kw)
        made.append(n)
        return n
    try:
        yield factory
    finally:
        _finish(request, made)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Test users whose removal had to wait for their nodes' clean-up (userkit.py): removed
    now; one that cannot be fails the run, by name."""
    from tests.userkit import remove_left_users

    failed = remove_left_users()
    if failed:
        print(f"\ntest users that could not be removed: {', '.join(failed)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
