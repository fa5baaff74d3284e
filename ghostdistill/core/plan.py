"""Which decoder blocks go: the pruning plan and its gaps. How a plan is chosen (its configuration and the
criteria) is `ghostdistill.planning`'s; this module is only the plan itself, which every layer reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Gap:
    """A maximal run of removed blocks [start, stop). `stop == num_layers` means the gap reaches the end."""

    start: int
    stop: int

    @property
    def key(self) -> str:
        return f"{self.start}-{self.stop - 1}"

    def __len__(self) -> int:
        return self.stop - self.start


def gaps_of(removed) -> list[Gap]:
    """The maximal runs of the removed block indices, in order."""
    gaps: list[Gap] = []
    for i in sorted(removed):
        if gaps and gaps[-1].stop == i:
            gaps[-1] = Gap(gaps[-1].start, i + 1)
        else:
            gaps.append(Gap(i, i + 1))
    return gaps


@dataclass(frozen=True)
class PruningPlan:
    num_layers: int
    removed: tuple[int, ...]
    chosen_by: str = "explicit"
    scores: dict[str, float] = field(default_factory=dict, compare=False)
    # Repair-aware criteria: per candidate what it was scored by (cosine, pruned and repaired KL, ...), and
    # the criterion's costs; empty for the others.
    candidates: dict[str, dict] = field(default_factory=dict, compare=False)
    costs: dict[str, float] = field(default_factory=dict, compare=False)

    @classmethod
    def from_layers(cls, layers: list[int], num_layers: int, *, allow_edges: bool = False, **kw) -> "PruningPlan":
        removed = tuple(sorted(set(int(i) for i in layers)))
        if len(removed) != len(layers):
            raise ValueError(f"plan.layers {layers} lists a layer twice; each layer can go once")
        bad = [i for i in removed if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"plan.layers {bad} out of range: the model has layers 0..{num_layers - 1}")
        if not removed:
            raise ValueError("plan.layers is empty: name at least one layer to remove")
        if len(removed) >= num_layers:
            raise ValueError(
                f"plan.layers removes all {num_layers} layers (0..{num_layers - 1}); at least one must remain"
            )
        if not allow_edges and (0 in removed or num_layers - 1 in removed):
            raise ValueError(
                f"plan.layers {list(removed)} removes the first or last layer (0 or {num_layers - 1}); "
                "set plan.allow_edges=true if you really mean it"
            )
        return cls(num_layers=num_layers, removed=removed, **kw)

    @property
    def kept(self) -> tuple[int, ...]:
        gone = set(self.removed)
        return tuple(i for i in range(self.num_layers) if i not in gone)

    @property
    def gaps(self) -> list[Gap]:
        return gaps_of(self.removed)

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "removed": list(self.removed),
            "kept": len(self.kept),
            "gaps": [g.key for g in self.gaps],
            "chosen_by": self.chosen_by,
            "scores": self.scores,
            **({"candidates": self.candidates} if self.candidates else {}),
            **({"costs": self.costs} if self.costs else {}),
        }
