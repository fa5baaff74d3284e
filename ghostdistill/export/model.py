"""One view of a pruned model as a `transformers` model in memory: the model that `export_view`'s folder
loads as, without the folder.

It is built from what the folder is written from (`writer.prepare`: the state dict and config, the
view's maps folded into the weights for a method that folds), by `from_pretrained` with that state dict, so
it is the same class, config and tensors as `from_pretrained(<exported folder>)` gives (the two kinds of folder:
`writer`): `GhostPrunedForCausalLM` for a view with operators, whose `save_pretrained` copies
`modeling_ghostdistill.py` beside the weights as export does (it is registered for `AutoModelForCausalLM`, as
remote-code models are), else the model's own class (e.g. `LlamaForCausalLM`) with fewer blocks.

No tensor is copied that the view does not change: the kept blocks' weights are the source model's own
tensors (as `export_view` writes them without a copy), so the returned model shares them with it.
"""

from __future__ import annotations

import copy

from torch import nn

from ..core.modeling_ghostdistill import GhostPrunedForCausalLM
from ..core.views import PrunedModel
from .writer import prepare


def view_model(pruned: PrunedModel, view: str, *, method: str | None, info: dict | None = None) -> nn.Module:
    """`view` of `pruned` as a `transformers` model in eval mode (see the module docstring); `method` and
    `info` as `export_view` takes them (the registered method behind the view; what config.json records)."""
    from transformers.utils import logging as hf_logging

    if view not in pruned.views:
        raise ValueError(f"view {view!r} is not a view of this model: the views are {pruned.views}")
    with pruned.use(view) as model:
        prepared = prepare(pruned, view, method, info=info)
        state, config, kind = prepared.state, prepared.config, prepared.kind
        generation = copy.deepcopy(getattr(model, "generation_config", None))
        cls = GhostPrunedForCausalLM if kind == "operators" else type(model)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" of tensors already in memory
    try:
        out = cls.from_pretrained(None, config=config, state_dict=state)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    if generation is not None:
        out.generation_config = generation
    if kind == "operators":
        # Registered as remote-code classes are, so that save_pretrained writes the modelling file, as export does.
        GhostPrunedForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    return out.eval()
