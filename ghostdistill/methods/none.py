"""No recovery: the pruned model under its own name (a view that fine-tuning can start from)."""

from __future__ import annotations

from ..core.plan import Gap
from .interface import GapFit, Method, MethodConfig, register


class NoRecovery(Method):
    name = "none"
    config = MethodConfig  # nothing to fit, so not even `order`
    ships_stock = True  # no map at any gap: the pruned model's own architecture
    card = "no repair (the pruned model)"

    def fit(self, cfg: MethodConfig, gap: Gap, stats: None, hidden_size: int) -> GapFit:
        return GapFit()

    def identity(self, cfg: MethodConfig, hidden_size: int) -> GapFit:
        return GapFit()


register(NoRecovery())
