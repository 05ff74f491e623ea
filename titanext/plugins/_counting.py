"""Opt-in traffic counters shared by the plugins' ``count_comm()`` context managers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Counters(Generic[T]):
    """The counters of the ``count_comm()`` blocks now open; each records what runs inside it.

    >>> counters = Counters(list)
    >>> with counters.open() as seen:
    ...     for c in counters:
    ...         c.append("sent")
    >>> seen, list(counters)
    (['sent'], [])
    """

    def __init__(self, factory: Callable[[], T]):
        self._factory = factory
        self._open: list[T] = []

    def __iter__(self) -> Iterator[T]:
        return iter(self._open)

    def __bool__(self) -> bool:
        return bool(self._open)

    @contextlib.contextmanager
    def open(self) -> Iterator[T]:
        counter = self._factory()
        self._open.append(counter)
        try:
            yield counter
        finally:
            self._open.remove(counter)
