"""What a student trains, one registered `Part` per kind of `distill.train` (the shipped ones: `distill.parts`).

A part says, in one object, what it makes trainable (`build`: the views' own copies or adapters), which
parameters train (`params`, by a name stable across runs: checkpoints hold them), at which learning rate
(`lr_key`, a field of the resolved `Student`), where a student's forward must start for it (`first_block`),
what FSDP2 does with it (`fsdp`: ``shard`` its modules, ``replicate`` them on every rank, or ``refuse``),
whether it changes the surviving blocks themselves (`adapts_blocks`: one such part per student) and what the
report and the export record of it besides its learning rate (`settings`), and the keys of its own (`options`, a
dataclass given per student as `part_options`, read by `options_of`). Export writes a student's view as
it computes: copies are the view's own modules and adapters merge into their weights.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import nn

from ..core.options import make_options
from ..core.plan import PruningPlan
from ..core.registry import Registry

Students = Any  # a `distill.students.Students` (which builds on this package)
Student = Any  # a resolved `distill.config.Student`, or its dict in results.json


class Part:
    """One kind of thing a student trains; the module docstring says what each member means."""

    name: str = ""
    lr_key: str = "lr"
    fsdp: Literal["shard", "replicate", "refuse"] = "shard"
    adapts_blocks: bool = False
    build_last: bool = False  # after the other parts (adapters go into the shared blocks the others copy)
    options: type | None = None  # a dataclass of its own keys, set as `part_options: {<name>: {...}}`

    def options_of(self, student: Student) -> Any:
        """The student's options of this part (`part_options[name]`) as its `options` class, checked."""
        held = student if isinstance(student, dict) else vars(student)
        given = (held.get("part_options") or {}).get(self.name)
        return make_options(self.options, given, f"student {held['name']}: part_options.{self.name}")

    def lr(self, student: Student) -> float:
        value = student
        for attr in self.lr_key.split("."):
            value = value[attr] if isinstance(value, dict) else getattr(value, attr)
        return value

    def first_block(self, plan: PruningPlan, student: Student) -> int | None:
        return None  # nothing it changes runs before the first gap

    def build(self, students: Students, views: list[str]) -> None:
        """Make `views`' trainable copies or adapters (every one of them trains this part)."""

    def params(self, students: Students, view: str, student: Student) -> dict[str, nn.Parameter]:
        return {}

    def settings(self, student: Student) -> dict:
        return {}


# `register(part)` makes it a kind of `distill.train: [<part.name>]`; `parts()`: the names, in registration order
# (the order of a student's parameter groups).
_PARTS: Registry[Part] = Registry("student part", "distill.train", Part)
register, unregister, parts, get_part = _PARTS.register, _PARTS.unregister, _PARTS.names, _PARTS.get
