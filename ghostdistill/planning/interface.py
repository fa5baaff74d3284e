"""The configuration of a plan (`PlanConfig`), what a criterion is given (`PlanInputs`), the `Criterion`
base class and the registry of criteria.

A criterion chooses which `num_layers` blocks go. It is a `Criterion` with (defaults on the base class)

- `name`: what `plan.criterion` names it by;
- `contiguous`: it removes one run of `num_layers` blocks (its candidates are the runs' first blocks), or
  any `num_layers` blocks (each removable block is a candidate); `check_plan` counts the candidates of
  either kind before any data is read;
- `costly`: its cost grows with the data by more than one forward per batch, so `plan.criterion_samples`
  caps the windows it reads (the chosen plan's fits always read them all);
- `repair_aware`: it fits a repair for every candidate and scores the repaired model on the held-out
  `data.selection` windows, so it needs the recovery entries and those windows;
- `options`: a dataclass of its own keys, given as `plan.criterion_options` and read by `options_of(cfg)`;
- `choose(cfg, inputs) -> PruningPlan`: the plan, with its scores (and for the repair-aware ones, the
  candidates' rows and the costs).

The config, the base class and the registry share this module because a config is checked against the
registry (`PlanConfig.validate`, `repair_aware`) and a criterion takes a config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.model import DecoderStack
from ..core.options import make_options
from ..core.plan import PruningPlan
from ..core.registry import Registry
from ..core.settings import digest_dict, setting
from ..methods import RecoveryConfig

Batch = dict[str, torch.Tensor]
Progress = Callable[[Iterable, str], Iterable]


def no_progress(items: Iterable, desc: str) -> Iterable:
    return items


# The keys only the repair-aware criteria read (set for another criterion, they are refused).
REPAIR_KEYS = ("repair_method", "repair_chunk", "greedy_from", "greedy_start")


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
        greedy_start: (``repair_greedy``) blocks removed before the search starts (fewer than
            `num_layers`); the search adds the others one at a time. E.g. the best contiguous plan of a
            smaller depth, so that the search looks only for what to remove besides it.
        criterion_options: the criterion's own keys (`Criterion.options`, a dataclass a criterion of your own
            declares), e.g. ``{threshold: 0.5}``; checked against its fields.
    """

    # What saved results make of each key is marked here (`core.settings`): the keys added after run folders
    # were fingerprinted are left out of a digest while unset; `repair_chunk` and `greedy_from` change what a
    # plan costs, never which plan it is. `tag`: the key in a `compare` plan's folder name.
    layers: list[int] | None = None
    criterion: str = "streamline"
    num_layers: int | None = None
    allow_edges: bool = setting(False, tag="edges")
    keep_first: int = setting(1, tag="kf")
    keep_last: int = setting(1, tag="kl")
    criterion_samples: int | None = setting(None, tag="cs")
    repair_method: str | None = setting(None, later=True, tag="by_")
    repair_chunk: int | None = setting(None, cost=True, later=True)
    greedy_from: str | None = setting(None, cost=True, later=True)
    greedy_start: list[int] | None = setting(None, later=True, tag="from")
    criterion_options: dict | None = setting(None, later=True)

    def validate(self) -> None:
        """The checks the values alone decide, run before the model is loaded (depth-dependent checks:
        `PruningPlan.from_layers` and the criteria's candidate counts, right after loading)."""
        if self.layers is not None and self.num_layers is not None:
            raise ValueError(
                f"plan.layers {self.layers} and plan.num_layers {self.num_layers} are both set: an explicit list "
                "removes exactly its layers; set plan.num_layers to null (--model.plan.num_layers null), or drop "
                "plan.layers to let plan.criterion choose num_layers layers"
            )
        if self.layers is None:
            get_criterion(self.criterion).options_of(self)  # an unknown one is named with the registered ones
        elif self.criterion_options:
            raise ValueError(
                "plan.criterion_options are the criterion's, and plan.layers names the blocks itself: remove one"
            )
        if self.layers is None and self.num_layers is None:
            raise ValueError("plan needs either layers (explicit list) or num_layers (for the criterion)")
        if self.layers is not None:
            if not self.layers:
                raise ValueError("plan.layers is empty: name at least one layer to remove (0-based block indices)")
            if negative := [i for i in self.layers if i < 0]:
                raise ValueError(f"plan.layers {negative} out of range: layers are 0-based indices, 0..num_layers-1")
            if twice := sorted({i for i in self.layers if self.layers.count(i) > 1}):
                raise ValueError(f"plan.layers {self.layers} lists layer(s) {twice} twice; each layer can go once")
        counts = {
            "num_layers": "how many layers the criterion removes",
            "criterion_samples": "or null for all windows",
            "repair_chunk": "or null: every candidate at once",
        }
        for key, what in counts.items():
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"plan.{key} must be >= 1 ({what}), got {getattr(self, key)}")
        if self.keep_first < 0 or self.keep_last < 0:
            raise ValueError(
                f"plan.keep_first and plan.keep_last must be >= 0, got {self.keep_first} and {self.keep_last}"
            )
        for key in REPAIR_KEYS:
            if getattr(self, key) is not None and not self.repair_aware():
                raise ValueError(
                    f"plan.{key} is read only by plan.criterion repair or repair_greedy (criterion: "
                    f"{self.criterion!r}{', with explicit plan.layers' if self.layers is not None else ''}): "
                    f"remove plan.{key}"
                )
        for key, what in (
            ("greedy_from", "names a repair_greedy run to take steps from"),
            ("greedy_start", "is where a repair_greedy search starts"),
        ):
            if getattr(self, key) is not None and self.criterion != "repair_greedy":
                raise ValueError(
                    f"plan.{key} {what}, and plan.criterion is {self.criterion!r}: set plan.criterion repair_greedy "
                    f"or remove plan.{key}"
                )
        start = self.greedy_start
        if start is None:
            return
        if self.greedy_from is not None:
            raise ValueError(
                "plan.greedy_start and plan.greedy_from both say where the search starts; keep one of them"
            )
        if not start or any(i < 0 for i in start) or len(set(start)) != len(start):
            raise ValueError(
                f"plan.greedy_start {start} must be distinct 0-based block indices, at least one (or null)"
            )
        if len(start) >= self.num_layers:
            raise ValueError(
                f"plan.greedy_start removes {len(start)} blocks and plan.num_layers is {self.num_layers}: the "
                "search adds blocks to the start, so name fewer blocks than num_layers (or set plan.layers)"
            )

    def repair_aware(self) -> bool:
        """Whether a repair-aware criterion chooses the plan (it reads `data.selection`)."""
        return self.layers is None and self.criterion in _CRITERIA and _CRITERIA.get(self.criterion).repair_aware

    def digest_dict(self) -> dict:
        """The settings that decide the plan, for a fingerprint: the cost-only keys left out, and the keys
        added later while unset (earlier run folders keep their fingerprints)."""
        return digest_dict(self)


@dataclass
class PlanInputs:
    """What a criterion reads: the dense model and its decoder stack, the calibration batches, a progress
    wrapper, and for the repair-aware criteria the recovery entries (whose closed form repairs each
    candidate), the selection windows (where it is scored) and `taken`, the steps of an earlier
    ``repair_greedy`` search of these settings (`plan.greedy_from`)."""

    model: nn.Module
    stack: DecoderStack
    batches: Sequence[Batch]
    progress: Progress = no_progress
    recovery: Sequence[RecoveryConfig] = ()
    selection: Sequence[Batch] | None = None
    taken: Sequence[dict] = field(default_factory=tuple)


class Criterion:
    """A way of choosing the blocks to remove; the module docstring says what each member means."""

    name: str  # set by every criterion (a dataclass criterion takes it as a field)
    contiguous: bool = False
    costly: bool = False
    repair_aware: bool = False
    options: type | None = None  # a dataclass of its own keys, set as `plan.criterion_options` (`core.options`)

    def options_of(self, cfg: PlanConfig):
        """`cfg.criterion_options` as this criterion's `options` class, checked (None: it declares none)."""
        return make_options(self.options, cfg.criterion_options, f"plan.criterion_options ({self.name})")

    def choose(self, cfg: PlanConfig, inputs: PlanInputs) -> PruningPlan:
        raise NotImplementedError(f"criterion {self.name!r} defines no choose")


# `register(criterion)` makes it `plan.criterion: <criterion.name>`; `criteria()`: the names, in registration order.
_CRITERIA: Registry[Criterion] = Registry("criterion", "plan.criterion", Criterion)
register, unregister, criteria, get_criterion = _CRITERIA.register, _CRITERIA.unregister, _CRITERIA.names, _CRITERIA.get
