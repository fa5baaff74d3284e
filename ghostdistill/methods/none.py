"""No recovery: the pruned model under its own name (a view that fine-tuning can start from)."""

from __future__ import annotations

import torch

from ..core.plan import Gap
from .interface import GapFit, NoFold, RecoveryConfig, register


class NoRecovery(NoFold):
    name = "none"
    keys: dict = {}  # nothing to fit, so not even `order`

    def collector(self, hidden_size: int, device: torch.device | str) -> None:
        return None

    def validate(self, cfg: RecoveryConfig) -> None:
        pass

    def fit(self, cfg: RecoveryConfig, gap: Gap, stats: None, hidden_size: int) -> GapFit:
        return GapFit()

    def identity(self, cfg: RecoveryConfig, hidden_size: int) -> GapFit:
        return GapFit()


register(NoRecovery())
