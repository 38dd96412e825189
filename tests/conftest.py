from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import Node


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node()
    try:
        yield n
    finally:
        n.cleanup()


@pytest.fixture
def make_node() -> Iterator[type[Node]]:
    made: list[Node] = []

    def factory(**kw: object) -> Node:
        n = Node(**kw)  # type: ignore[arg-type]
        made.append(n)
        return n
    try:
        yield factory  # type: ignore[misc]
    finally:
        for n in made:
            n.cleanup()
