"""One registry of named plug-ins, for every kind the package is extended by: recovery methods
(`methods.register`), plan criteria (`planning.register`), student parts (`distill.parts.register`) and export
formats (`export.formats.register`).

A name names one object: registering another object under a name already taken is refused, naming both
(the one registered and the one refused), rather than silently replacing the first (a plug-in that shadows
`ghost` would change every run that names it). Registering the same object again is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


def origin(item: object) -> str:
    """Where a registered object comes from: its class's module and name."""
    cls = item if isinstance(item, type) else type(item)
    return f"{cls.__module__}.{cls.__qualname__}"


class Registry(Generic[T]):
    """Registered objects by name, in registration order.

    Args:
        kind: what an entry is, in messages (``recovery method``).
        setting: where a user names one, in messages (``plan.criterion``).
    """

    def __init__(self, kind: str, setting: str) -> None:
        self.kind, self.setting = kind, setting
        self._items: dict[str, T] = {}

    def add(self, name: str, item: T) -> T:
        """Register `item` as `name`; returns it. A taken name is refused, naming both registrants."""
        if not isinstance(name, str) or not name.replace("-", "_").isidentifier():  # `compressed-tensors` has dashes
            raise ValueError(f"{self.kind} name {name!r} must be a Python identifier (dashes allowed)")
        taken = self._items.get(name)
        if taken is not None and taken is not item:
            raise ValueError(
                f"{self.kind} {name!r} is registered by {origin(taken)}; {origin(item)} cannot take the name: "
                f"give it another one (or unregister {name!r} first)"
            )
        self._items[name] = item
        return item

    def remove(self, name: str) -> None:
        self._items.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def get(self, name: str) -> T:
        if name not in self._items:
            raise ValueError(f"{self.setting} {name!r} is not known; choose one of {', '.join(self._items)}")
        return self._items[name]

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[T]:
        return iter(self._items.values())
