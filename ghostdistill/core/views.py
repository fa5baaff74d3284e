"""Removing blocks from a model, with cheap switching between the dense, pruned and repaired views.

All views share the same block objects: switching swaps the ModuleList, `config.num_hidden_layers`,
per-layer config lists and the blocks' `layer_idx` (which the KV cache is indexed by), so the dense
teacher costs no extra memory while the kept blocks are frozen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .model import DecoderStack, decoder_stack, mlp_module, text_config
from .modeling_ghostdistill import attach
from .offload import model_device, offloaded_tied_copies
from .operator import GhostOperator
from .plan import Gap, PruningPlan

DENSE = "dense"
PRUNED = "pruned"

# Config attributes that hold one entry per block and must shrink with the stack.
PER_LAYER_CONFIG_LISTS = ("layer_types", "no_rope_layers", "sliding_window_pattern_list")


class PrunedModel:
    """A dense model plus a pruning plan, and one set of gap operators per recovery method.

    `set_view("dense")` restores the original model; `set_view("pruned")` drops the planned blocks;
    `set_view(method)` drops them and applies that method's operators at each gap. A view may also
    replace some surviving blocks by its own copies (`substitute_blocks`: fine-tuning whole blocks
    leaves the dense teacher's blocks untouched), and listeners hear every view change (fine-tuning
    switches LoRA adapters there).
    """

    def __init__(self, model: nn.Module, plan: PruningPlan) -> None:
        self.model = model
        self.plan = plan
        self.stack: DecoderStack = decoder_stack(model)
        self.dense_layers: list[nn.Module] = list(self.stack.layers)
        if len(self.dense_layers) != plan.num_layers:
            raise ValueError(f"plan is for {plan.num_layers} layers but the model has {len(self.dense_layers)}")
        # The config the blocks are described by (a wrapper's base config for an exported ghost model).
        self.config = text_config(model)
        self._config_lists = {
            name: list(getattr(self.config, name))
            for name in PER_LAYER_CONFIG_LISTS
            if isinstance(getattr(self.config, name, None), (list, tuple))
            and len(getattr(self.config, name)) == plan.num_layers
        }
        # method name -> gap key -> operator on the residual stream at the gap, and (ReplaceMe) a map on
        # the MLP output of the block before the gap. ModuleDicts, so the owner can register, move and
        # train them.
        self.operators = nn.ModuleDict()
        self.mlp_maps = nn.ModuleDict()
        # view -> str(dense block index) -> that view's own copy of the block.
        self.blocks = nn.ModuleDict()
        # view -> path (dots as '/') -> that view's own copy of a module elsewhere: the output head, the
        # final norm, a norm inside a shared block (`substitute_modules`).
        self.modules_own = nn.ModuleDict()
        self._slots: dict[str, list[tuple[nn.Module, str, str]]] = {}  # view -> (parent, attribute, key)
        self._originals: dict[tuple[int, str], tuple[nn.Module, str, nn.Module]] = {}
        self.view = DENSE
        self.skip = 0
        self.listeners: list[Callable[[str], None]] = []
        self._handles = [self._host(gap, self.dense_layers) for gap in plan.gaps]
        self._mlp_hooked: set[str] = set()

    # ------------------------------------------------------------------ views
    def set_view(self, view: str, skip: int = 0) -> None:
        """Switch to `view`. `skip` leaves out the view's first blocks (a forward then starts from the
        residual stream entering block `skip`, passed as the input embeddings)."""
        if view not in (DENSE, PRUNED) and view not in self.operators:
            raise ValueError(f"unknown view {view!r}; available: {self.views}")
        indices = list(range(self.plan.num_layers) if view == DENSE else self.plan.kept)
        if not 0 <= skip < len(indices):
            raise ValueError(f"skip={skip} must leave at least one of the view's {len(indices)} blocks")
        indices = indices[skip:]
        own = self.blocks[view] if view in self.blocks else {}
        layers = [own[str(i)] if str(i) in own else self.dense_layers[i] for i in indices]
        self.stack.set_layers(layers)
        self.config.num_hidden_layers = len(layers)
        for name, values in self._config_lists.items():
            setattr(self.config, name, [values[i] for i in indices])
        for new_idx, layer in enumerate(layers):
            for module in layer.modules():
                if hasattr(module, "layer_idx"):
                    module.layer_idx = new_idx
        for parent, attr, original in self._originals.values():
            setattr(parent, attr, original)
        for parent, attr, key in self._slots.get(view, ()):
            setattr(parent, attr, self.modules_own[view][key])
        self.view, self.skip = view, skip
        for listener in self.listeners:
            listener(view)

    @contextlib.contextmanager
    def use(self, view: str, skip: int = 0) -> Iterator[nn.Module]:
        previous = (self.view, self.skip)
        self.set_view(view, skip)
        try:
            yield self.model
        finally:
            self.set_view(*previous)

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
            raise ValueError(
                f"method {name!r} names gaps {sorted(unknown)} that the plan does not have ({sorted(keys)})"
            )
        if operators and set(operators) != keys:
            raise ValueError(f"method {name!r} has no operator for gaps {sorted(keys - set(operators))}")
        device = model_device(self.model)
        self.operators[name] = nn.ModuleDict(operators).to(device)
        self.mlp_maps[name] = nn.ModuleDict(mlp_maps).to(device)
        for gap in self.plan.gaps:
            if gap.key in mlp_maps and gap.key not in self._mlp_hooked:
                self._handles.append(self._host_mlp(gap, self.dense_layers[gap.start - 1]))
                for own in self.blocks.values():
                    if str(gap.start - 1) in own:
                        self._handles.append(self._host_mlp(gap, own[str(gap.start - 1)]))
                self._mlp_hooked.add(gap.key)

    def substitute_blocks(self, view: str, blocks: dict[int, nn.Module]) -> None:
        """Give `view` its own modules for some surviving blocks (dense indices); the gap operators and
        MLP maps act on them as on the shared ones."""
        if view not in self.operators:
            raise ValueError(f"substitute_blocks: {view!r} is not a method view; available: {self.views}")
        removed = set(self.plan.removed)
        bad = [i for i in blocks if i in removed or not 0 <= i < self.plan.num_layers]
        if bad:
            raise ValueError(f"substitute_blocks: blocks {bad} are not surviving blocks (kept: {list(self.plan.kept)})")
        layers = [blocks.get(i, self.dense_layers[i]) for i in range(self.plan.num_layers)]
        self.blocks[view] = nn.ModuleDict({str(i): m for i, m in blocks.items()})
        for gap in self.plan.gaps:
            host = gap.stop if gap.stop < self.plan.num_layers else gap.start - 1
            if host in blocks:
                self._handles.append(self._host(gap, layers))
            if gap.key in self._mlp_hooked and gap.start - 1 in blocks:
                self._handles.append(self._host_mlp(gap, blocks[gap.start - 1]))

    def substitute_modules(self, view: str, modules: dict[str, nn.Module]) -> None:
        """Give `view` its own modules in place of others, by their path in the dense model (``lm_head``,
        ``model.norm``, ``model.layers.4.input_layernorm``: block paths name dense indices, and a block
        the view already has its own copy of is refused, its copy being that view's already). The
        originals stay for every other view and the teacher."""
        if view not in self.operators:
            raise ValueError(f"substitute_modules: {view!r} is not a method view; available: {self.views}")
        own = self.blocks[view] if view in self.blocks else {}
        slots, table = list(self._slots.get(view, ())), dict(self.modules_own[view]) if view in self.modules_own else {}
        with self.use(DENSE):
            layers_path = next(n for n, m in self.model.named_modules(remove_duplicate=False) if m is self.stack.layers)
            for path, module in modules.items():
                parent_path, _, attr = path.rpartition(".")
                parent = self.model.get_submodule(parent_path) if parent_path else self.model
                original = getattr(parent, attr, None)
                if not isinstance(original, nn.Module):
                    raise ValueError(f"substitute_modules: {path!r} is not a module of {type(self.model).__name__}")
                block = int(path[len(layers_path) + 1 :].split(".")[0]) if path.startswith(layers_path + ".") else None
                if block is not None and (block in self.plan.removed or str(block) in own):
                    raise ValueError(
                        f"substitute_modules: {path!r} is in block {block}, which {view!r} does not run from the "
                        "shared blocks (removed, or its own copy)"
                    )
                key = path.replace(".", "/")
                self._originals.setdefault((id(parent), attr), (parent, attr, original))
                slots.append((parent, attr, key))
                table[key] = module.to(model_device(self.model))
        self.modules_own[view] = nn.ModuleDict(table)
        self._slots[view] = slots
        self.set_view(self.view, self.skip)

    def _repair(self, table: nn.ModuleDict, gap: Gap) -> GhostOperator | None:
        """The current view's entry of `table` (its operators or its MLP maps) at `gap`; None where it has none."""
        if self.view in (DENSE, PRUNED) or gap.key not in table[self.view]:
            return None
        return table[self.view][gap.key]

    def _host_mlp(self, gap: Gap, block: nn.Module):
        if gap.start == 0:
            raise ValueError(f"gap {gap.key} starts at block 0: there is no MLP before it to fuse into")

        def hook(module, args, output):
            mlp_map = self._repair(self.mlp_maps, gap)
            return None if mlp_map is None else mlp_map(output)

        return mlp_module(block).register_forward_hook(hook)

    def _host(self, gap: Gap, layers: list[nn.Module]):
        """The operator acts on the residual stream entering the first block after the gap; when the
        gap reaches the end of the stack it acts on the output of the last block before it instead."""
        if gap.stop < self.plan.num_layers:
            return attach(layers[gap.stop], "input", lambda: self._repair(self.operators, gap))
        if gap.start == 0:
            raise ValueError("the plan removes every block; nothing is left to host an operator")
        return attach(layers[gap.start - 1], "output", lambda: self._repair(self.operators, gap))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


# Names of LoRA adapter parameters (peft). Adapters merge into the weights they adapt when a view is
# exported, so they are not counted as parameters of any view.
_ADAPTER_NAMES = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


@torch.no_grad()
def view_parameter_count(pruned: PrunedModel, view: str) -> int:
    """Parameters the view needs at inference: its blocks plus the operators it inserts (maps that
    export folds into existing weights add nothing). A tied weight counts once, offloaded or not."""
    with pruned.use(view) as model:
        copies = offloaded_tied_copies(model)
        total = sum(
            p.numel()
            for name, p in model.named_parameters()
            if name not in copies and not any(f".{a}." in f".{name}." for a in _ADAPTER_NAMES)
        )
    if view not in (DENSE, PRUNED):
        for group in (pruned.operators[view], pruned.mlp_maps[view]):
            total += sum(op.inference_parameters() for op in group.values())
    return total
