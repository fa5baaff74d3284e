"""What each kind of student training copies or adapts, found in the model without naming its family.

- ``blocks``: the surviving blocks next to each gap (`adjacent_blocks`);
- ``tail``: the last k surviving blocks (`tail_blocks`), the output head and the final norm (`tail_modules`);
- ``norms``: every norm layer with a gain inside the surviving blocks a view runs from the shared ones
  (`norm_modules`);
- ``lora``: one peft adapter per student on the surviving blocks (`add_lora`);

and, for the hidden-state term, where the residual stream after each gap enters the next module
(`stream_sites`).
"""

from __future__ import annotations

import warnings

from torch import nn

from ..core.head import decoder_of
from ..core.plan import PruningPlan
from ..core.views import DENSE, PrunedModel
from .config import Student


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer with a gain (RMSNorm or LayerNorm of any family)."""
    return "norm" in type(module).__name__.lower() and isinstance(getattr(module, "weight", None), nn.Parameter)


def adjacent_blocks(plan: PruningPlan) -> list[int]:
    """Surviving blocks next to a gap: the one after it and the one before it."""
    out = set()
    for gap in plan.gaps:
        if gap.stop < plan.num_layers:
            out.add(gap.stop)
        if gap.start > 0:
            out.add(gap.start - 1)
    return sorted(out)


def tail_blocks(plan: PruningPlan, k: int) -> list[int]:
    """The last `k` surviving blocks (dense indices)."""
    kept = list(plan.kept)
    return kept[len(kept) - min(k, len(kept)) :]


def tail_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The output head and the final norm, by path in the model."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    head = model.get_output_embeddings()
    norm = getattr(decoder_of(model), "norm", None)
    if head is None or not isinstance(norm, nn.Module):
        raise ValueError(
            f"distill.train tail: {type(model).__name__} has no output head or no final norm at "
            "`<decoder>.norm`; train operators, lora or blocks instead"
        )
    return {names[id(head)]: head, names[id(norm)]: norm}


def norm_modules(pruned: PrunedModel, view: str) -> dict[str, nn.Module]:
    """The norm modules of the surviving blocks `view` runs from the shared ones, by path in the model."""
    own = pruned.blocks[view] if view in pruned.blocks else {}
    with pruned.use(DENSE) as model:
        layers = {id(b): i for i, b in enumerate(pruned.dense_layers)}
        out = {}
        for path, block in model.named_modules():
            i = layers.get(id(block))
            if i is None or i in pruned.plan.removed or str(i) in own:
                continue
            out |= {f"{path}.{name}": m for name, m in block.named_modules() if name and is_norm(m)}
    if not out and not own:
        raise ValueError(f"distill.train norms: no norm layer with a gain found in the blocks of {view}")
    return out


def add_lora(pruned: PrunedModel, specs: dict[str, Student]) -> list[nn.Module]:
    """One peft adapter named after each student of `specs` on the surviving blocks; returns every adapted
    layer."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    with pruned.use(DENSE) as model:
        for view, spec in specs.items():
            settings = spec.lora
            config = LoraConfig(
                r=settings.rank,
                lora_alpha=settings.alpha,
                lora_dropout=settings.dropout,
                target_modules=list(settings.target_modules),
                layers_to_transform=list(pruned.plan.kept),
                layers_pattern=pruned.stack.attr,
            )
            with warnings.catch_warnings():
                # One adapter per student on the same blocks is the point; peft warns about it.
                warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
                inject_adapter_in_model(config, model, adapter_name=view)
            layers = [m for m in pruned.model.modules() if isinstance(m, BaseTunerLayer)]
            if not any(view in getattr(m, "lora_A", {}) for m in layers):
                raise ValueError(
                    f"distill.lora.target_modules {settings.target_modules} ({view}) matched no layer of the blocks"
                )
    return [m for m in pruned.model.modules() if isinstance(m, BaseTunerLayer)]


def stream_sites(pruned: PrunedModel, view: str) -> list[nn.Module]:
    """Per gap, the module whose input is the residual stream after the gap in `view`: the first block
    after it (the view's own copy if it has one), or the final norm for a gap at the end of the stack."""
    own = pruned.blocks[view] if view in pruned.blocks else {}
    sites = []
    for gap in pruned.plan.gaps:
        if gap.stop < pruned.plan.num_layers:
            sites.append(own[str(gap.stop)] if str(gap.stop) in own else pruned.dense_layers[gap.stop])
            continue
        with pruned.use(view) as model:
            norm = getattr(decoder_of(model), "norm", None)
        if not isinstance(norm, nn.Module):
            raise ValueError(
                f"distill.loss.hidden_weight: gap {gap.key} ends the stack and {type(model).__name__} has no "
                "final norm at `<decoder>.norm` whose input to compare; set hidden_weight to 0"
            )
        sites.append(norm)
    return sites
