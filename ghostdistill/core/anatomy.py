"""What a loaded causal LM is made of: its decoder stack and final norm, a block's MLP and output projections,
the hidden size, and a batch's inputs on the model's device (`core.model` loads the model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .offload import model_device

# Where common decoder-only families keep their blocks and their final norm, relative to the
# top-level model. Anything else is found by the generic search in `decoder_stack`.
_STACK_PATHS = ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers", "transformer.layers")
_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_norm", "norm_f")


def _get(root: nn.Module, dotted: str) -> nn.Module | None:
    try:
        return root.get_submodule(dotted)  # "" is `root` itself
    except AttributeError:
        return None


@dataclass
class DecoderStack:
    """Where a model keeps its blocks: `owner.<attr>` is the ModuleList; `norm` follows the last block."""

    owner: nn.Module
    attr: str
    norm: nn.Module | None

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.owner, self.attr)

    def set_layers(self, layers: list[nn.Module]) -> None:
        setattr(self.owner, self.attr, nn.ModuleList(layers))


def decoder_stack(model: nn.Module) -> DecoderStack:
    """Find the decoder blocks of a decoder-only model without naming its family: known attribute paths first
    (an exported ghost model's `config.layers_path` before them), else the one ModuleList of
    `config.num_hidden_layers` entries. Fails with the class name when there is none."""
    num_layers = getattr(text_config(model), "num_hidden_layers", None)
    own = getattr(getattr(model, "config", None), "layers_path", None)
    for path in ([own] if own else []) + list(_STACK_PATHS):
        layers = _get(model, path)
        if isinstance(layers, nn.ModuleList) and (num_layers is None or len(layers) == num_layers):
            break
    else:
        candidates = [
            name
            for name, mod in model.named_modules()
            if isinstance(mod, nn.ModuleList) and num_layers is not None and len(mod) == num_layers
        ]
        if len(candidates) != 1:
            raise TypeError(
                f"cannot find the decoder blocks of {type(model).__name__}: ghostdistill needs a decoder-only model "
                f"whose blocks sit in one nn.ModuleList of config.num_hidden_layers={num_layers} entries "
                f"(looked at {', '.join(_STACK_PATHS)} and found {len(candidates)} matching ModuleLists)"
            )
        path = candidates[0]
    owner_path, _, attr = path.rpartition(".")
    owner = _get(model, owner_path)
    norm = next((getattr(owner, n) for n in _NORM_NAMES if isinstance(getattr(owner, n, None), nn.Module)), None)
    return DecoderStack(owner=owner, attr=attr, norm=norm)


def text_config(model: nn.Module):
    """The config that describes the decoder stack: the model's own, or the base model's config of a
    wrapper (an exported ghost model keeps it as `config.text_config`, the same object its base uses)."""
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def hidden_size(model: nn.Module) -> int:
    return int(text_config(model).hidden_size)


def mlp_module(block: nn.Module) -> nn.Module:
    """The feed-forward sub-module of a block (its output is added to the residual stream)."""
    for name in ("mlp", "feed_forward", "ffn"):
        mod = getattr(block, name, None)
        if isinstance(mod, nn.Module):
            return mod
    raise TypeError(f"{type(block).__name__} has no `mlp` sub-module (looked for mlp, feed_forward, ffn)")


# Projections through which a block writes to the residual stream (attention output, MLP output), by the
# names the common families use; folding a map into weights needs them.
ATTN_OUT = ("o_proj", "c_proj", "out_proj", "dense")
MLP_OUT = ("down_proj", "c_proj", "fc2", "dense_4h_to_h")


def last_linear(module: nn.Module, names: tuple[str, ...]) -> nn.Linear:
    """The first of `names` that is an nn.Linear attribute of `module` (the projection to fold into)."""
    lin = next((getattr(module, n) for n in names if isinstance(getattr(module, n, None), nn.Linear)), None)
    if lin is None:
        raise TypeError(f"{type(module).__name__} has none of {names}; cannot fold into it")
    return lin


def model_inputs(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of a batch on the model's device; a missing mask means no padding."""
    device = model_device(model)
    ids = batch["input_ids"].to(device)
    mask = batch.get("attention_mask")
    return ids, (torch.ones_like(ids) if mask is None else mask.to(device))
