"""Which decoder blocks go: the pruning plan and its gaps."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

CriterionName = Literal[
    "streamline", "angular", "angular_last", "block_influence", "ppl", "taylor", "repair", "repair_greedy"
]
# Criteria that fit a repair for every candidate and score the repaired model (`ghostdistill.planning`).
REPAIR_CRITERIA = ("repair", "repair_greedy")
# PlanConfig keys added after run folders were fingerprinted: left out of a digest while unset (None), so
# the statistics saved before they existed keep their key.
LATER_KEYS = ("repair_method", "repair_chunk", "greedy_from")
# Keys that change what a plan costs, never which plan it is: no part of a fingerprint.
COST_KEYS = ("repair_chunk", "greedy_from")


@dataclass
class PlanConfig:
    """Either an explicit list of layers to remove, or a criterion that picks `num_layers` of them.

    Args:
        layers: 0-based indices of the blocks to remove; several gaps are allowed. Only `allow_edges`
            constrains an explicit list (`keep_first`/`keep_last` apply to criteria).
        criterion: how to choose the blocks when `layers` is not given. Contiguous run of `num_layers`:
            ``streamline`` (the run whose input and output are most cosine-similar, averaged over all
            non-padding tokens), ``angular`` (Gromov et al. 2024 angular distance over all tokens) or
            ``angular_last`` (same, last non-padding token of each sequence only). Any `num_layers`
            blocks, possibly non-contiguous, ranked one by one: ``block_influence`` (ShortGPT, Men et al.
            2024: 1 - cosine between a block's input and output; one forward pass per batch), ``ppl``
            (Shortened LLaMA, Kim et al. 2024: perplexity of the model with only that block removed;
            one forward pass per candidate block per batch) or ``taylor`` (Shortened LLaMA: sum of
            |weight x gradient of the next-token loss| over the block's parameters; one forward and
            backward pass per batch, plus a gradient's worth of memory for the candidate blocks).
            Repair-aware (ghostdistill's own; `ghostdistill.planning`): ``repair`` fits `repair_method`'s
            closed form for every contiguous run of `num_layers` blocks from one dense pass and keeps the
            run whose repaired model has the lowest KL(dense ‖ repaired) on `data.selection`'s held-out
            windows; ``repair_greedy`` removes one block at a time, any block, each step keeping the
            block whose removal (every gap repaired) gives the lowest KL.
        num_layers: how many blocks the criterion removes.
        allow_edges: permit removing the first or the last block (off: both carry outsized roles).
            For criteria, true means ``keep_first: 0, keep_last: 0`` (any other keep_first/keep_last
            than the defaults 1/1 or 0/0 alongside it is rejected as a contradiction).
        keep_first: how many of the first blocks a criterion may never remove.
        keep_last: how many of the last blocks a criterion may never remove. Shortened LLaMA's
            Taylor+ is ``criterion: taylor, keep_first: 4, keep_last: 2``.
        criterion_samples: when set, the criteria that cost many passes (``ppl``, ``taylor``, and the
            candidates' statistics of ``repair`` and ``repair_greedy``) read only the first this many
            calibration windows; the others always use them all, and the chosen plan's fits read them all.
        repair_method: (``repair``, ``repair_greedy``) whose closed form repairs each candidate: the name
            of a `recovery` entry (its settings), or a registered method (its defaults); default the
            first `recovery` entry. ``none`` scores the pruned model itself.
        repair_chunk: (``repair``) candidates whose statistics are held at once (one dense calibration
            pass per chunk); default all of them, in one pass. Only memory depends on it, not the plan.
        greedy_from: (``repair_greedy``) a finished ``repair_greedy`` run (its folder or results.json)
            made with this run's settings but another `num_layers`: its steps are this run's first
            steps (the greedy is deterministic), so they are taken from its report and the search goes
            on from there; checked by fingerprint, so a run with other settings is refused by name.
            Only time depends on it, not the plan. `compare` sets it between its own greedy plans.
    """

    layers: list[int] | None = None
    criterion: CriterionName = "streamline"
    num_layers: int | None = None
    allow_edges: bool = False
    keep_first: int = 1
    keep_last: int = 1
    criterion_samples: int | None = None
    repair_method: str | None = None
    repair_chunk: int | None = None
    greedy_from: str | None = None

    def validate(self) -> None:
        """The checks the values alone decide, run before the model is loaded (depth-dependent checks:
        `PruningPlan.from_layers` and the criteria's candidate counts, right after loading)."""
        if self.layers is not None and self.num_layers is not None:
            raise ValueError(
                f"plan.layers {self.layers} and plan.num_layers {self.num_layers} are both set: an explicit list "
                "removes exactly its layers; set plan.num_layers to null (--model.plan.num_layers null), or drop "
                "plan.layers to let plan.criterion choose num_layers layers"
            )
        if self.layers is None and self.num_layers is None:
            raise ValueError("plan needs either layers (explicit list) or num_layers (for the criterion)")
        if self.layers is not None:
            if not self.layers:
                raise ValueError("plan.layers is empty: name at least one layer to remove (0-based block indices)")
            negative = [i for i in self.layers if i < 0]
            if negative:
                raise ValueError(f"plan.layers {negative} out of range: layers are 0-based indices, 0..num_layers-1")
            twice = sorted({i for i in self.layers if self.layers.count(i) > 1})
            if twice:
                raise ValueError(f"plan.layers {self.layers} lists layer(s) {twice} twice; each layer can go once")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(
                f"plan.num_layers must be >= 1 (how many layers the criterion removes), got {self.num_layers}"
            )
        if self.keep_first < 0 or self.keep_last < 0:
            raise ValueError(
                f"plan.keep_first and plan.keep_last must be >= 0, got {self.keep_first} and {self.keep_last}"
            )
        if self.criterion_samples is not None and self.criterion_samples < 1:
            raise ValueError(
                f"plan.criterion_samples must be >= 1 (or null for all windows), got {self.criterion_samples}"
            )
        if self.repair_chunk is not None and self.repair_chunk < 1:
            raise ValueError(
                f"plan.repair_chunk must be >= 1 (or null: every candidate at once), got {self.repair_chunk}"
            )
        for key in LATER_KEYS:
            if getattr(self, key) is not None and not self.repair_aware():
                raise ValueError(
                    f"plan.{key} is read only by plan.criterion repair or repair_greedy (criterion: "
                    f"{self.criterion!r}{', with explicit plan.layers' if self.layers is not None else ''}): "
                    f"remove plan.{key}"
                )
        if self.greedy_from is not None and self.criterion != "repair_greedy":
            raise ValueError(
                f"plan.greedy_from names a repair_greedy run to take steps from, and plan.criterion is "
                f"{self.criterion!r}: set plan.criterion repair_greedy or remove plan.greedy_from"
            )

    def repair_aware(self) -> bool:
        """Whether a repair-aware criterion chooses the plan (it reads `data.selection`)."""
        return self.layers is None and self.criterion in REPAIR_CRITERIA

    def digest_dict(self) -> dict:
        """The settings that decide the plan, for a fingerprint: `repair_chunk` and `greedy_from` change only
        memory and time, and keys added later are left out while unset (earlier run folders keep their
        fingerprints)."""
        out = {k: v for k, v in asdict(self).items() if k not in COST_KEYS}
        return {k: v for k, v in out.items() if k not in LATER_KEYS or v is not None}


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
        gaps: list[Gap] = []
        for i in self.removed:
            if gaps and gaps[-1].stop == i:
                gaps[-1] = Gap(gaps[-1].start, i + 1)
            else:
                gaps.append(Gap(i, i + 1))
        return gaps

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
