"""The students of fine-tuned recovery and the teacher they learn from, over one set of blocks.

Each fine-tuned method gets a view ``<method>_ft`` whose trainable parts start from the method's
closed-form fit:

- ``operators``: copies of the method's gap operators (and ReplaceMe's MLP maps), trained; the
  training-free view keeps the frozen originals;
- ``lora``: a peft LoRA adapter named after the view on the surviving blocks, active only while that
  view runs (every other view, the teacher first, runs with adapters off, so its output is bit for bit
  the base model's);
- ``blocks``: per-view copies of the surviving blocks next to each gap (`PrunedModel.substitute_blocks`),
  so the teacher and the other views keep the originals.

The teacher is the dense view: frozen, eval mode, no gradients. When nothing before the first gap
trains (operators, or blocks that all lie after the first gap), the blocks before the first gap compute
the same thing for the teacher and every student: the teacher pass keeps the residual stream entering
the first gap and each student starts from it (its embedding input replaced, the blocks before the gap
skipped). `check_prefix` verifies that shortcut against a full student forward and turns it off where a
family does something to its input embeddings.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..core.head import decoder_of
from ..core.model import model_inputs
from ..core.views import DENSE, PrunedModel, copy_block
from .config import DistillConfig, ft_view


@dataclass
class StudentParams:
    """A student's trainable parameters by kind (each kind has its own learning rate)."""

    operators: list[nn.Parameter]
    lora: list[nn.Parameter]
    blocks: list[nn.Parameter]

    def all(self) -> list[nn.Parameter]:
        return [*self.operators, *self.lora, *self.blocks]


class Students:
    """The `<method>_ft` views of one run and what trains in each."""

    def __init__(self, pruned: PrunedModel, cfg: DistillConfig) -> None:
        self.pruned = pruned
        self.cfg = cfg
        self.views = [ft_view(m) for m in cfg.methods]
        self.params: dict[str, StudentParams] = {}
        self.named: dict[str, dict[str, nn.Parameter]] = {}
        self._lora_layers: list[nn.Module] = []
        self.share_prefix = False
        # The first block whose input differs between teacher and students: the first gap, or the
        # block before it when that block trains as a copy.
        self.prefix_block = min(g.start for g in pruned.plan.gaps)
        if "blocks" in cfg.train:
            self.prefix_block = min([self.prefix_block, *self.adjacent_blocks()])

    # ---------------------------------------------------------------- building
    def build(self) -> None:
        """Create every fine-tuned view from its method's fitted view; freeze everything else."""
        pruned = self.pruned
        pruned.model.requires_grad_(False)
        pruned.operators.requires_grad_(False)
        pruned.mlp_maps.requires_grad_(False)
        train = set(self.cfg.train)
        for method, view in zip(self.cfg.methods, self.views):
            operators = {k: copy.deepcopy(op) for k, op in pruned.operators[method].items()}
            mlp_maps = {k: copy.deepcopy(op) for k, op in pruned.mlp_maps[method].items()}
            pruned.add_method(view, operators, mlp_maps)
            has_maps = any(True for group in (pruned.operators[view], pruned.mlp_maps[view]) for _ in group.values())
            if train == {"operators"} and not has_maps:
                raise ValueError(
                    f"distill: method {method!r} has no operators to train (e.g. `none`); add lora or blocks to "
                    "distill.train"
                )
            if "blocks" in train:
                pruned.substitute_blocks(view, {i: copy_block(pruned.dense_layers[i]) for i in self.adjacent_blocks()})
        if "lora" in train:
            self._add_lora()
        self.refresh_params()
        self.share_prefix = (
            self.cfg.share_prefix and self.prefix_block > 0 and not ("lora" in train and self._lora_before_first_gap())
        )
        pruned.listeners.append(self._on_view)
        self._on_view(pruned.view)

    def adjacent_blocks(self) -> list[int]:
        """Surviving blocks next to a gap: the one after it and the one before it."""
        plan, out = self.pruned.plan, set()
        for gap in plan.gaps:
            if gap.stop < plan.num_layers:
                out.add(gap.stop)
            if gap.start > 0:
                out.add(gap.start - 1)
        return sorted(out)

    def _lora_before_first_gap(self) -> bool:
        return any(i < self.prefix_block for i in self.pruned.plan.kept)

    def _add_lora(self) -> None:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.tuners_utils import BaseTunerLayer

        settings = self.cfg.lora
        pruned = self.pruned
        with pruned.use(DENSE) as model:
            for view in self.views:
                config = LoraConfig(
                    r=settings.rank,
                    lora_alpha=settings.alpha,
                    lora_dropout=settings.dropout,
                    target_modules=list(settings.target_modules),
                    layers_to_transform=list(pruned.plan.kept),
                    layers_pattern=pruned.stack.attr,
                )
                with warnings.catch_warnings():
                    # One adapter per method on the same blocks is the point; peft warns about it.
                    warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
                    inject_adapter_in_model(config, model, adapter_name=view)
        self._lora_layers = [m for m in pruned.model.modules() if isinstance(m, BaseTunerLayer)]
        if not self._lora_layers:
            raise ValueError(f"distill.lora.target_modules {settings.target_modules} matched no layer of the blocks")

    def refresh_params(self) -> None:
        """Collect each student's trainable parameters from its modules, by name, and mark them trainable.
        Run again after anything replaces parameter objects (FSDP2 sharding does)."""
        pruned, train = self.pruned, set(self.cfg.train)
        # Adapters are named by the dense index of their block, whatever view is active.
        lora_names = {
            id(m): f"lora.{i}.{name}"
            for i, block in enumerate(pruned.dense_layers)
            for name, m in block.named_modules()
        }
        for view in self.views:
            # The gap operators (with the first-position shift where the fit uses one) and MLP maps.
            operators = (
                {
                    f"{kind}.{view}.{key}.{name}": p
                    for kind, group in (("operators", pruned.operators[view]), ("mlp_maps", pruned.mlp_maps[view]))
                    for key, op in group.items()
                    for name, p in op.named_parameters()
                    if name != "first_shift" or op.separate_first
                }
                if "operators" in train
                else {}
            )
            lora = {
                f"{lora_names.get(id(layer), '?')}.{name}": p
                for layer in self._lora_layers
                for name, p in layer.named_parameters()
                if f".{view}." in f".{name}."
            }
            blocks = {
                f"blocks.{view}.{index}.{name}": p
                for index, m in (pruned.blocks[view].items() if view in pruned.blocks else ())
                for name, p in m.named_parameters()
            }
            self.named[view] = {**operators, **lora, **blocks}
            self.params[view] = StudentParams(
                operators=list(operators.values()), lora=list(lora.values()), blocks=list(blocks.values())
            )
            for p in self.params[view].all():
                p.requires_grad_(True)

    def _on_view(self, view: str) -> None:
        """Adapters on for a fine-tuned view (its own), off for every other view (the teacher first).

        peft's switches also flip `requires_grad`; the trainable flags are put back, since a leaf whose
        flag is off at backward time receives no gradient."""
        if not self._lora_layers:
            return
        active = view in self.views
        for layer in self._lora_layers:
            layer.enable_adapters(active)
            if active:
                layer.set_adapter(view)
        for params in self.params.values():
            for p in params.lora:
                p.requires_grad_(True)

    # ---------------------------------------------------------------- forwards
    def teacher(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The dense model's final hidden states (after the final norm) and, when prefixes are shared, the
        residual stream entering the first gap."""
        model = self.pruned.model
        ids, mask = model_inputs(model, batch)
        captured: dict[str, torch.Tensor] = {}
        handle = None
        if self.share_prefix:

            def grab(module, args, kwargs):
                captured["prefix"] = args[0] if args else kwargs["hidden_states"]

            handle = self.pruned.dense_layers[self.prefix_block].register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.no_grad(), self.pruned.use(DENSE) as m:
                hidden = decoder_of(m)(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        finally:
            if handle is not None:
                handle.remove()
        return hidden, captured.get("prefix")

    def student(self, view: str, batch: dict[str, torch.Tensor], prefix: torch.Tensor | None) -> torch.Tensor:
        """A student's final hidden states, from the shared prefix when given."""
        model = self.pruned.model
        ids, mask = model_inputs(model, batch)
        if prefix is None:
            with self.pruned.use(view) as m:
                return decoder_of(m)(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        with self.pruned.use(view, skip=self.prefix_block) as m:
            return decoder_of(m)(inputs_embeds=prefix, attention_mask=mask, use_cache=False).last_hidden_state

    @torch.no_grad()
    def check_prefix(self, batch: dict[str, torch.Tensor]) -> bool:
        """Use the shared prefix only if it reproduces a student's full forward on this batch; returns
        whether it is on."""
        if not self.share_prefix or not self.views:
            return self.share_prefix
        view = self.views[0]
        full = self.student(view, batch, None)
        _, prefix = self.teacher(batch)
        short = self.student(view, batch, prefix)
        tol = 1e-4 if full.dtype == torch.float32 else 2e-2
        if not torch.allclose(full.float(), short.float(), atol=tol, rtol=tol):
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(
                f"{type(self.pruned.model).__name__}: starting the students after block {self.prefix_block} "
                "does not reproduce their full forward (the family transforms its input embeddings); "
                "running the full forward for every student instead"
            )
            self.share_prefix = False
        return self.share_prefix

    # ---------------------------------------------------------------- state
    def trainable_state(self, view: str) -> dict[str, torch.Tensor]:
        """A copy of a student's trainable values by parameter name (to keep its best step); sharded
        parameters keep their shard, so each rank copies only its part."""
        return {name: p.detach().clone() for name, p in self.named[view].items()}

    @torch.no_grad()
    def load_trainable_state(self, view: str, state: dict[str, torch.Tensor]) -> None:
        """Put saved values (`trainable_state`'s names) back into a student; the names must match exactly."""
        params = self.named[view]
        if set(state) != set(params):
            missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
            raise ValueError(
                f"{view}: the saved state does not hold this student's tensors (missing {missing[:3]}, "
                f"unexpected {extra[:3]}); it was saved with other distill settings"
            )
        for name, p in params.items():
            value = state[name]
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"{view}: {name} has shape {tuple(value.shape)} saved, {tuple(p.shape)} here")
            if hasattr(p, "full_tensor") and not hasattr(value, "full_tensor"):
                # A whole tensor from a checkpoint into a sharded parameter: take this rank's part.
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value.to(p.device, p.dtype), p.device_mesh, p.placements)
            p.copy_(value.to(p.device, p.dtype) if not hasattr(value, "full_tensor") else value)
