"""Removing blocks from a model, with cheap switching between the dense, pruned and repaired views.

All views share the same block objects: switching swaps the ModuleList, `config.num_hidden_layers`,
per-layer config lists and the blocks' `layer_idx` (which the KV cache is indexed by), so the dense
teacher costs no extra memory while the kept blocks are frozen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .model import DecoderStack, decoder_stack, mlp_module
from .operator import GhostOperator, first_position_mask
from .plan import Gap, PruningPlan

DENSE = "dense"
PRUNED = "pruned"

# Config attributes that hold one entry per block and must shrink with the stack.
PER_LAYER_CONFIG_LISTS = ("layer_types", "no_rope_layers", "sliding_window_pattern_list")


class PrunedModel:
    """A dense model plus a pruning plan, and one set of gap operators per recovery method.

    `set_view("dense")` restores the original model; `set_view("pruned")` drops the planned blocks;
    `set_view(method)` drops them and applies that method's operators at each gap.
    """

    def __init__(self, model: nn.Module, plan: PruningPlan) -> None:
        self.model = model
        self.plan = plan
        self.stack: DecoderStack = decoder_stack(model)
        self.dense_layers: list[nn.Module] = list(self.stack.layers)
        if len(self.dense_layers) != plan.num_layers:
            raise ValueError(f"plan is for {plan.num_layers} layers but the model has {len(self.dense_layers)}")
        self._config_lists = {
            name: list(getattr(model.config, name))
            for name in PER_LAYER_CONFIG_LISTS
            if isinstance(getattr(model.config, name, None), (list, tuple))
            and len(getattr(model.config, name)) == plan.num_layers
        }
        # method name -> gap key -> operator on the residual stream at the gap, and (ReplaceMe) a map on
        # the MLP output of the block before the gap. ModuleDicts, so the owner can register, move and
        # train them.
        self.operators = nn.ModuleDict()
        self.mlp_maps = nn.ModuleDict()
        self.view = DENSE
        self._handles = [self._host(gap) for gap in plan.gaps]
        self._mlp_hooked: set[str] = set()

    # ------------------------------------------------------------------ views
    def set_view(self, view: str) -> None:
        if view not in (DENSE, PRUNED) and view not in self.operators:
            raise ValueError(f"unknown view {view!r}; available: {self.views}")
        indices = range(self.plan.num_layers) if view == DENSE else self.plan.kept
        layers = [self.dense_layers[i] for i in indices]
        self.stack.set_layers(layers)
        self.model.config.num_hidden_layers = len(layers)
        for name, values in self._config_lists.items():
            setattr(self.model.config, name, [values[i] for i in indices])
        for new_idx, layer in enumerate(layers):
            for module in layer.modules():
                if hasattr(module, "layer_idx"):
                    module.layer_idx = new_idx
        self.view = view

    @contextlib.contextmanager
    def use(self, view: str) -> Iterator[nn.Module]:
        previous = self.view
        self.set_view(view)
        try:
            yield self.model
        finally:
            self.set_view(previous)

    @property
    def views(self) -> list[str]:
        return [DENSE, PRUNED, *self.operators.keys()]

    # -------------------------------------------------------------- operators
    def add_method(
        self,
        name: str,
        operators: dict[str, GhostOperator] | None = None,
        mlp_maps: dict[str, GhostOperator] | None = None,
    ) -> None:
        """Register (or replace) a method's view. `operators` act at the gaps; `mlp_maps` on the MLP output
        of the block before each gap. A method with neither is the pruned model under another name."""
        if name in (DENSE, PRUNED):
            raise ValueError(f"method name {name!r} is reserved")
        operators, mlp_maps = operators or {}, mlp_maps or {}
        keys = {g.key for g in self.plan.gaps}
        unknown = (set(operators) | set(mlp_maps)) - keys
        if unknown:
            raise ValueError(f"method {name!r} names gaps {sorted(unknown)} that the plan does not have ({sorted(keys)})")
        if operators and set(operators) != keys:
            raise ValueError(f"method {name!r} has no operator for gaps {sorted(keys - set(operators))}")
        device = next(self.model.parameters()).device
        self.operators[name] = nn.ModuleDict(operators).to(device)
        self.mlp_maps[name] = nn.ModuleDict(mlp_maps).to(device)
        for gap in self.plan.gaps:
            if gap.key in mlp_maps and gap.key not in self._mlp_hooked:
                self._handles.append(self._host_mlp(gap))
                self._mlp_hooked.add(gap.key)

    def _operator(self, gap: Gap) -> GhostOperator | None:
        if self.view in (DENSE, PRUNED) or gap.key not in self.operators[self.view]:
            return None
        return self.operators[self.view][gap.key]

    def _host_mlp(self, gap: Gap):
        if gap.start == 0:
            raise ValueError(f"gap {gap.key} starts at block 0: there is no MLP before it to fuse into")

        def hook(module, args, output):
            if self.view in (DENSE, PRUNED) or gap.key not in self.mlp_maps[self.view]:
                return None
            return self.mlp_maps[self.view][gap.key](output)

        return mlp_module(self.dense_layers[gap.start - 1]).register_forward_hook(hook)

    def _host(self, gap: Gap):
        """The operator acts on the residual stream entering the first block after the gap; when the
        gap reaches the end of the stack it acts on the output of the last block before it instead."""
        if gap.stop < self.plan.num_layers:

            def pre_hook(module, args, kwargs):
                op = self._operator(gap)
                if op is None:
                    return None
                hidden, rest = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
                first = first_position_mask(kwargs.get("position_ids"), hidden)
                return (op(hidden, first), *rest), kwargs

            return self.dense_layers[gap.stop].register_forward_pre_hook(pre_hook, with_kwargs=True)
        if gap.start == 0:
            raise ValueError("the plan removes every block; nothing is left to host an operator")

        def post_hook(module, args, kwargs, output):
            op = self._operator(gap)
            if op is None:
                return None
            hidden = output[0] if isinstance(output, tuple) else output
            first = first_position_mask(kwargs.get("position_ids"), hidden)
            new = op(hidden, first)
            return (new, *output[1:]) if isinstance(output, tuple) else new

        return self.dense_layers[gap.start - 1].register_forward_hook(post_hook, with_kwargs=True)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@torch.no_grad()
def view_parameter_count(pruned: PrunedModel, view: str) -> int:
    """Parameters the view needs at inference: its blocks plus the operators it inserts (maps that
    export folds into existing weights add nothing)."""
    with pruned.use(view) as model:
        total = count_parameters(model)
    if view not in (DENSE, PRUNED):
        for group in (pruned.operators[view], pruned.mlp_maps[view]):
            total += sum(op.inference_parameters() for op in group.values())
    return total
