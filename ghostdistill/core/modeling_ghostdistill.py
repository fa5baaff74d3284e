"""A layer-pruned causal LM with ghost operators at its gaps, as a Hugging Face model.

This file is self-contained (torch and transformers only): `ghostdistill export` copies it into every
exported folder that keeps operators (ghost, LinearPatch), where `auto_map` registers it, so

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

loads the model where ghostdistill is not installed. ghostdistill's own views use the same operator,
first-position rule and hooks from here, so the exported model decides exactly as the in-memory view.

The model is generic over decoder families: the config holds the base family's keys, flat (with the
surviving number of blocks; `GhostPrunedConfig.base_config()` is the family's own config object),
`AutoModelForCausalLM.from_config` builds that architecture, and each gap's operator acts on the residual
stream at one block of it:

- ordinary tokens: x ← x + x·M (W = I + M, the closed-form least-squares map, possibly fine-tuned);
- first-position tokens (position id 0) when `separate_first`: x ← x + b. With the KV cache a decode
  step holds no position-0 token, so only the prefill applies b; with left padding `generate` derives
  the position ids from the attention mask, so the first real token is position 0 (the padding, also
  given position 0, is masked out of attention and changes nothing);
- `where: input` acts on the input of block `layer` (a forward pre-hook); `where: output` (a gap at
  the end of the stack) on the output of block `layer`.

Operators are stored in float32 and applied in the activations' dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel


def first_position_mask(position_ids: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    """Tokens at position 0 of their sequence, shaped like hidden[..., 0].

    Blocks called without position ids (older families) get the plain arange, which is right for
    unpadded inputs without a cache."""
    batch, seq = hidden.shape[:2]
    if position_ids is None:
        position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)
    return (position_ids == 0).expand(batch, seq)


class GapOperator(nn.Module):
    """x ← x + x·M for ordinary tokens; x ← x + b for first-position tokens when `separate_first`."""

    def __init__(self, hidden_size: int, *, separate_first: bool = False) -> None:
        super().__init__()
        self.delta = nn.Parameter(torch.zeros(hidden_size, hidden_size))
        self.first_shift = nn.Parameter(torch.zeros(hidden_size))
        self.separate_first = separate_first

    def forward(self, x: torch.Tensor, first_mask: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if torch.is_autocast_enabled(x.device.type):
            # Under autocast addmm would round the whole residual stream to the autocast dtype: only the
            # product runs there, the residual add stays in the stream's own dtype (as the teacher's does).
            y = (flat + flat @ self.delta).to(x.dtype).view_as(x)
        else:
            # addmm: the product and the residual add in one kernel; `.to` is free when dtypes agree.
            y = torch.addmm(flat, flat, self.delta.to(x.dtype)).view_as(x)
        if self.separate_first and first_mask is not None:
            y = torch.where(first_mask.unsqueeze(-1), x + self.first_shift.to(x.dtype), y)
        return y


def attach(block: nn.Module, where: str, get_op: Callable[[], GapOperator | None]):
    """Hook `get_op()` onto a block's input hidden states (`where="input"`, a forward pre-hook) or its output
    (`"output"`, a forward hook), both with kwargs; returns the handle."""

    def on_input(module, args, kwargs):
        op = get_op()
        if op is None:
            return None
        hidden, rest = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
        first = first_position_mask(kwargs.get("position_ids"), hidden)
        return (op(hidden, first), *rest), kwargs

    def on_output(module, args, kwargs, output):
        op = get_op()
        if op is None:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        new = op(hidden, first_position_mask(kwargs.get("position_ids"), hidden))
        return (new, *output[1:]) if isinstance(output, tuple) else new

    if where == "input":
        return block.register_forward_pre_hook(on_input, with_kwargs=True)
    if where == "output":
        return block.register_forward_hook(on_output, with_kwargs=True)
    raise ValueError(f"where={where!r}: an operator acts on a block's 'input' or 'output'")


# Keys of the config that are ghostdistill's own; every other key is the base family's.
_OWN_KEYS = ("model_type", "base_model_type", "gaps", "layers_path", "ghostdistill", "architectures", "auto_map")


class GhostPrunedConfig(PreTrainedConfig):
    """The base family's config, flat (its keys as they are, `num_hidden_layers` the surviving blocks), plus
    the gaps.

    Args:
        base_model_type: the base family's `model_type` (any decoder family `AutoConfig` knows).
        gaps: one entry per gap: ``{"key", "layer", "where", "separate_first"}`` (`layer` indexes the
            surviving blocks).
        layers_path: where the base causal LM keeps its blocks (e.g. ``model.layers``).
        ghostdistill: what produced the folder (plan, method, calibration, seed, metrics).
        text_config: the base config nested, as folders exported before version 0.2 hold it; its keys are
            taken flat.

    Flat, not nested: a text model whose config nests another is taken for a multimodal one by vLLM's
    Transformers backend, which serves this model. Every key the base family has is an attribute here, so
    what reads a text model's config (vLLM, `generate`) reads this one; `base_config()` is the family's own
    config object, which the base model is built from. The config is built as transformers' own configs are
    (a `__post_init__`, no version's sub-config machinery), so the file loads on every transformers 5.x that
    vLLM and ghostdistill install (5.16 on).
    """

    model_type = "ghostdistill"

    base_model_type: str = "llama"
    gaps: list | None = None
    layers_path: str = "model.layers"
    ghostdistill: dict | None = None

    def __post_init__(self, **kwargs):
        nested = kwargs.pop("text_config", None)
        if nested is not None:
            nested = dict(nested.to_dict() if isinstance(nested, PreTrainedConfig) else nested)
            self.base_model_type = nested.get("model_type", self.base_model_type)
            # The family's own keys, never ghostdistill's (its `architectures` names the family's class).
            kwargs = {**{k: v for k, v in nested.items() if k not in (*_OWN_KEYS, "transformers_version")}, **kwargs}
        self.gaps = list(self.gaps or [])
        for gap in self.gaps:
            if gap.get("where") not in ("input", "output"):
                raise ValueError(f"gap {gap}: where must be 'input' or 'output'")
        super().__post_init__(**kwargs)

    def base_config(self) -> PreTrainedConfig:
        """The base family's config object (a new one at each call), with this config's attention
        implementation and dtype: what the base model is built from."""
        keys = {k: v for k, v in self.to_dict().items() if k not in (*_OWN_KEYS, "transformers_version")}
        base = AutoConfig.for_model(self.base_model_type, **keys)
        base._attn_implementation = self._attn_implementation
        base.dtype = self.dtype
        return base


def _operators_on(config: GhostPrunedConfig, layers: nn.Module) -> nn.ModuleList:
    """One `GapOperator` per gap of `config`, hooked onto the blocks in `layers` (the ModuleList of the
    surviving blocks); returns them as a ModuleList for the caller to own."""
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{config.layers_path} is not the ModuleList of blocks")
    hidden = int(config.hidden_size)
    operators = nn.ModuleList(
        GapOperator(hidden, separate_first=bool(g.get("separate_first", False))) for g in config.gaps
    )
    for gap, op in zip(config.gaps, operators):
        if not 0 <= int(gap["layer"]) < len(layers):
            raise ValueError(f"gap {gap} names block {gap['layer']}; the model has {len(layers)}")
        attach(layers[int(gap["layer"])], gap["where"], lambda op=op: op)
    return operators


class GhostPrunedPreTrainedModel(PreTrainedModel):
    """What both classes share: the config, the attention backends the base family supports (its attention
    dispatches through transformers' attention interface, which is what vLLM's Transformers backend
    replaces), and identity operators for a fresh model."""

    config_class = GhostPrunedConfig
    # Checkpoints hold the base causal LM under `pruned.` and the operators under `gap_operators.`.
    base_model_prefix = "pruned"
    supports_gradient_checkpointing = True
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module: nn.Module) -> None:
        # A fresh operator is the identity (M = 0, b = 0); the base model initialises its own modules.
        if isinstance(module, GapOperator):
            nn.init.zeros_(module.delta)
            nn.init.zeros_(module.first_shift)


class GhostPrunedModel(GhostPrunedPreTrainedModel):
    """The base model (`AutoModel`): the family's base model (`self.model`, e.g. `LlamaModel`) with
    `self.gap_operators` hooked onto its blocks; returns the final hidden states.

    This is the class vLLM's Transformers backend builds (`auto_map.AutoModel`): vLLM swaps the linears,
    norms and attention of `self.model` for its own and adds its own output head, and the operators stay
    forward hooks on the blocks. vLLM packs the sequences of a batch into one row, so the first-position
    rule reads the position ids (0 at every sequence's first token), never the index in the row."""

    def __init__(self, config: GhostPrunedConfig) -> None:
        super().__init__(config)
        self.model = AutoModel.from_config(config.base_config())
        # `layers_path` is the causal LM's (`model.layers`); the base model is its first part.
        self.gap_operators = _operators_on(config, self.model.get_submodule(config.layers_path.split(".", 1)[-1]))
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.set_input_embeddings(value)

    def get_decoder(self) -> nn.Module:
        return self.model

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        # Every other argument (the cache, `use_cache`, vLLM's attention arguments) goes to the base model as it is.
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            **kwargs,
        )


class GhostPrunedForCausalLM(GhostPrunedPreTrainedModel, GenerationMixin):
    """The family's causal LM (`self.pruned`) with `self.gap_operators` hooked onto its blocks."""

    def __init__(self, config: GhostPrunedConfig) -> None:
        super().__init__(config)
        self.pruned = AutoModelForCausalLM.from_config(config.base_config())
        self.gap_operators = _operators_on(config, self.pruned.get_submodule(config.layers_path))
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.pruned.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.pruned.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module | None:
        return self.pruned.get_output_embeddings()

    def get_decoder(self) -> nn.Module:
        return self.pruned.get_decoder()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ):
        # The cache travels in `kwargs` under whichever name this transformers version uses.
        return self.pruned(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )


def register_auto_classes() -> None:
    """Register the classes with the Auto factories, so a folder loads without remote code."""
    AutoConfig.register(GhostPrunedConfig.model_type, GhostPrunedConfig, exist_ok=True)
    AutoModel.register(GhostPrunedConfig, GhostPrunedModel, exist_ok=True)
    AutoModelForCausalLM.register(GhostPrunedConfig, GhostPrunedForCausalLM, exist_ok=True)
