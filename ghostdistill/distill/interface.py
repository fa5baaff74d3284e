"""The interface of a student part and the registry of parts: what `distill.train` may name.

A `Part` is one kind of thing a student trains (`distill.parts` holds the shipped ones and says what each
member means); `register` makes it a kind of `distill.train` (a taken name is refused, naming both). This
module is the bottom of the package so that the config checks `distill.train` against the registry.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import nn

from ..core.plan import PruningPlan
from ..core.registry import Registry

Students = Any  # a `distill.students.Students`
Student = Any  # a `distill.config.Student` (resolved), or its dict in results.json


class Part:
    """One kind of thing a student trains (`distill.train: [<name>, ...]`); the module docstring says what
    each member means. `build` and `params` are given the run's `Students`."""

    name: str = ""
    lr_key: str = "lr"
    fsdp: Literal["shard", "replicate", "refuse"] = "shard"
    adapts_blocks: bool = False
    # Built after every other part (adapters go into the shared blocks, which the other parts copy first).
    build_last: bool = False

    def lr(self, student: Student) -> float:
        """This part's learning rate in `student` (a resolved `Student`, or its dict in results.json)."""
        value = student
        for attr in self.lr_key.split("."):
            value = value[attr] if isinstance(value, dict) else getattr(value, attr)
        return value

    def first_block(self, plan: PruningPlan, student: Student) -> int | None:
        """The first block whose computation this part changes (None: none before the first gap)."""
        return None

    def build(self, students: Students, views: list[str]) -> None:
        """Make `views`' trainable copies or adapters (every one of them trains this part)."""

    def params(self, students: Students, view: str, student: Student) -> dict[str, nn.Parameter]:
        """The trainable parameters of this part in `view`, by a name that is stable across runs."""
        return {}

    def settings(self, student: Student) -> dict:
        """What the report and the export record of this part besides its learning rate."""
        return {}


_PARTS: Registry[Part] = Registry("student part", "distill.train")


def register(part: Part) -> Part:
    """Make `part` a kind of `distill.train: [<part.name>]`; returns it."""
    if not isinstance(part, Part):
        raise TypeError(f"{part!r} does not implement ghostdistill.distill.parts.Part (subclass it)")
    return _PARTS.add(part.name, part)


def unregister(name: str) -> None:
    _PARTS.remove(name)


def parts() -> tuple[str, ...]:
    """The registered parts' names, in registration order (the order of a student's parameter groups)."""
    return _PARTS.names()


def get_part(name: str) -> Part:
    return _PARTS.get(name)
