"""The interface of a recovery method: what one batch shows of a gap (`GapTaps`), what a method puts at a
gap (`GapFit`), the `Collector` and `Method` protocols, and small shared pieces. `methods.base` documents
what each member does; `methods.config` holds the configuration and the registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

from ..core.operator import GhostOperator
from ..core.plan import Gap

if TYPE_CHECKING:  # annotations only: `methods.config` imports this module at run time
    from .config import RecoveryConfig


@dataclass
class GapTaps:
    """What one batch shows of one gap: the residual stream entering the gap (`x_pre`) and the one the
    next surviving block should see (`x_post`), the padding mask, the first-position mask, and the MLP
    output of the last block before the gap (only captured when a collector asks, `needs_mlp`)."""

    x_pre: torch.Tensor
    x_post: torch.Tensor
    mask: torch.Tensor
    first: torch.Tensor
    mlp_out: torch.Tensor | None = None


@dataclass
class GapFit:
    """What one method puts at one gap."""

    operator: GhostOperator | None = None
    mlp_map: GhostOperator | None = None


@runtime_checkable
class Collector(Protocol):
    """Per-gap statistics. `needs_mlp` (optional attribute, default False) asks for `GapTaps.mlp_out`."""

    def update(self, taps: GapTaps) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class Method(Protocol):
    """A recovery method; see the module docstring for what each member does.

    Besides these members a method declares `keys`: the `RecoveryConfig` keys its fit reads, each with
    its default (e.g. ``{"variant": "rotate", "order": "sequential"}``); every other key is rejected for
    it. Without `keys` a method reads `order` only. (`keys` is not a Protocol member, so methods written
    before it still register.)
    """

    name: str
    folds: bool

    def collector(self, hidden_size: int, device: torch.device | str) -> Collector | None: ...

    def validate(self, cfg: RecoveryConfig) -> None: ...

    def fit(self, cfg: RecoveryConfig, gap: Gap, stats: Collector | None, hidden_size: int) -> GapFit: ...

    def identity(self, cfg: RecoveryConfig, hidden_size: int) -> GapFit: ...

    def fold(self, blocks: list[nn.Module], gap: Gap, fit: GapFit) -> None: ...


class NoFold:
    """Mixin for methods whose maps stay as inserted modules."""

    folds = False

    def fold(self, blocks: list[nn.Module], gap: Gap, fit: GapFit) -> None:
        raise NotImplementedError(f"{type(self).__name__} inserts an operator; it cannot be folded into weights")


def residual_identity(cfg: RecoveryConfig, hidden_size: int, *, fused: bool = False) -> GapFit:
    """A do-nothing operator on the residual stream at the gap."""
    return GapFit(operator=GhostOperator(hidden_size, fused=fused))
