"""Immutable value classes without ``dataclasses``, whose import pulls ``inspect`` in and costs
every CLI, agent and supervisor start ~6 ms (plus ~0.3 ms per decorated class).

A subclass lists its fields in ``__slots__`` and sets them in ``__init__`` with ``_init``;
equality, hashing and ``repr`` follow the fields, in that order.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class Frozen:
    __slots__: tuple[str, ...] = ()

    def _init(self, **fields: Any) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f) for f in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Frozen) and type(other) is type(self) \
            and self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__slots__)
        return f"{type(self).__name__}({fields})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), dict(zip(self.__slots__, self._values(), strict=True))))


def _rebuild(cls: type[Frozen], fields: dict[str, Any]) -> Frozen:
    obj = cls.__new__(cls)
    obj._init(**fields)
    return obj
