"""One registry of named plug-ins for every kind the package is extended by: recovery methods, plan criteria,
student parts and export formats (each package's `register`).

A name names one object: registering another under a taken name is refused, naming both (the registered one
and the refused one), rather than silently replacing the first (a plug-in shadowing `ghost` would change every
run that names it). Registering the same object again changes nothing. A plug-in's `options` (a dataclass of
its own keys, `core.options`) is checked when it registers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from .options import check_options_class

T = TypeVar("T")


def origin(item: object) -> str:
    """Where a registered object comes from: its class's module and name."""
    cls = item if isinstance(item, type) else type(item)
    return f"{cls.__module__}.{cls.__qualname__}"


class Registry(Generic[T]):
    """Objects of `base` by their `name`, in registration order; `kind` names an entry and `setting` where a
    user names one, in messages (``criterion``, ``plan.criterion``)."""

    def __init__(self, kind: str, setting: str, base: type) -> None:
        self.kind, self.setting, self.base = kind, setting, base
        self._items: dict[str, T] = {}

    def register(self, item: T) -> T:
        if not isinstance(item, self.base):
            raise TypeError(f"{item!r} does not implement {origin(self.base)} (subclass it)")
        name = getattr(item, "name", None)
        if not isinstance(name, str) or not name.replace("-", "_").isidentifier():  # `compressed-tensors` has dashes
            raise ValueError(f"{self.kind} name {name!r} must be a Python identifier (dashes allowed)")
        check_options_class(getattr(item, "options", None), f"{self.kind} {name!r} ({origin(item)})")
        taken = self._items.get(name)
        if taken is not None and taken is not item:
            raise ValueError(
                f"{self.kind} {name!r} is registered by {origin(taken)}; {origin(item)} cannot take the name: "
                f"give it another one (or unregister {name!r} first)"
            )
        self._items[name] = item
        return item

    def unregister(self, name: str) -> None:
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
