"""The one way an op registers a lowering into a back-end's table: a decorator that refuses a second, different
function for the same key (two ops claiming one name would silently shadow each other)."""

from __future__ import annotations

from typing import Callable


def registrar(table: dict[str, Callable], key: str, what: str) -> Callable[[Callable], Callable]:
    """A decorator putting its function in ``table[key]``; ``what`` names the key in the error ("t2n_extra::x has
    two handlers")."""

    def register(function: Callable) -> Callable:
        if table.get(key, function) is not function:
            raise TypeError(f"{what}: {table[key].__module__} and {function.__module__}")
        table[key] = function
        return function

    return register
