"""The shipped student parts (`distill.interface.Part`, registered on import), and what they find in a model
without naming its family: the modules they copy and, for the hidden-state term, where the residual stream
after each gap enters the next module (`stream_sites`).

| part        | trains                                                                        | lr        | FSDP2     |
|-------------|-------------------------------------------------------------------------------|-----------|-----------|
| `operators` | copies of the method's gap operators and MLP maps (`Method.student_operator`)  | `lr`      | shard     |
| `lora`      | one peft adapter per student on the surviving blocks                          | `lora.lr` | replicate |
| `blocks`    | copies of the surviving blocks next to each gap                               | `block_lr`| shard     |
| `tail`      | copies of the output head, the final norm and the last k surviving blocks     | `block_lr`| refuse    |
| `norms`     | copies of the norm layers of the surviving blocks the view shares             | `norm_lr` | refuse    |

A view's block copies (of `blocks`, or `tail`'s last k) train in the `blocks` group.
"""

from __future__ import annotations

import copy
import warnings

from torch import nn

from ..core.head import decoder_of
from ..core.plan import PruningPlan
from ..core.sharded import plain_copy
from ..core.views import DENSE, PrunedModel
from ..methods import get_method, registered
from .config import Student
from .interface import Part, Students, register


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer with a gain (RMSNorm or LayerNorm of any family)."""
    return "norm" in type(module).__name__.lower() and isinstance(getattr(module, "weight", None), nn.Parameter)


def adjacent_blocks(plan: PruningPlan) -> list[int]:
    """Surviving blocks next to a gap: the one after it and the one before it."""
    return sorted({i for gap in plan.gaps for i in (gap.start - 1, gap.stop) if 0 <= i < plan.num_layers})


def tail_blocks(plan: PruningPlan, k: int) -> list[int]:
    """The last `k` surviving blocks (dense indices)."""
    return list(plan.kept)[max(len(plan.kept) - k, 0) :]


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


def own_modules(students: Students, view: str, modules: dict[str, nn.Module]) -> None:
    """Give `view` its own copies of `modules` (paths in the model), for the teacher to keep the originals."""
    students.pruned.substitute_modules(view, {path: copy.deepcopy(m) for path, m in modules.items()})


def _own_params(students: Students, view: str, keep) -> dict[str, nn.Parameter]:
    """The parameters of `view`'s own modules (`substitute_modules`) whose path `keep(path)` accepts."""
    own = students.pruned.modules_own[view] if view in students.pruned.modules_own else {}
    return {
        f"modules.{view}.{key}.{name}": p
        for key, m in own.items()
        if keep(key.replace("/", "."))
        for name, p in m.named_parameters()
    }


class Operators(Part):
    name = "operators"

    def build(self, students: Students, views: list[str]) -> None:
        pruned = students.pruned
        for view in views:
            spec = students.specs[view]
            maps = [*pruned.operators[view].values(), *pruned.mlp_maps[view].values()]
            if set(spec.train) == {self.name} and not maps:
                raise ValueError(
                    f"distill: student {view!r} (method {spec.method!r}) has no operators to train (e.g. `none`); "
                    "train lora, blocks, tail or norms as well"
                )
            method = students.methods.get(spec.method, spec.method)
            if method in registered():
                # A method whose operators fold trains within what folds (rotation: the scaled rotations).
                wrap = get_method(method).student_operator
                operators = {k: wrap(op) for k, op in pruned.operators[view].items()}
                pruned.add_method(view, operators, dict(pruned.mlp_maps[view]))

    def params(self, students: Students, view: str, student: Student) -> dict[str, nn.Parameter]:
        if not student.trains(self.name):
            return {}
        pruned = students.pruned
        # The gap operators (with the first-position shift where the fit uses one) and MLP maps.
        return {
            f"{kind}.{view}.{key}.{name}": p
            for kind, group in (("operators", pruned.operators[view]), ("mlp_maps", pruned.mlp_maps[view]))
            for key, op in group.items()
            for name, p in op.named_parameters()
            if name != "first_shift" or op.separate_first
        }


class Lora(Part):
    name = "lora"
    lr_key = "lora.lr"
    fsdp = "replicate"  # every student's adapter sits in the same shared blocks (`distill.parallel`)
    adapts_blocks = True
    build_last = True

    def first_block(self, plan: PruningPlan, student: Student) -> int | None:
        return plan.kept[0] if plan.kept else None

    def build(self, students: Students, views: list[str]) -> None:
        """One peft adapter named after each of `views` on the surviving blocks."""
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.tuners_utils import BaseTunerLayer

        pruned = students.pruned
        with pruned.use(DENSE) as model:
            for view in views:
                settings = students.specs[view].lora
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
                if not any(view in getattr(m, "lora_A", {}) for m in model.modules() if isinstance(m, BaseTunerLayer)):
                    raise ValueError(
                        f"distill.lora.target_modules {settings.target_modules} ({view}) matched no layer of the blocks"
                    )
        layers = [m for m in pruned.model.modules() if isinstance(m, BaseTunerLayer)]
        students.state["lora"] = layers

        def on_view(view: str) -> None:
            """A student's own adapter on while it runs, every adapter off for every other view (the
            teacher first). peft's switches also flip `requires_grad`; the trainable flags are put back,
            since a leaf whose flag is off at backward time receives no gradient."""
            for layer in layers:
                layer.enable_adapters(view in views)
                if view in views:
                    layer.set_adapter(view)
            for v in students.views:
                for p in students.params.get(v, {}).get(self.name, ()):
                    p.requires_grad_(True)

        students.pruned.listeners.append(on_view)

    def params(self, students: Students, view: str, student: Student) -> dict[str, nn.Parameter]:
        layers = students.state.get("lora", ())
        # Adapters are named by the dense index of their block, whatever view is active.
        names = {
            id(m): f"lora.{i}.{name}"
            for i, b in enumerate(students.pruned.dense_layers)
            for name, m in b.named_modules()
        }
        return {
            f"{names.get(id(layer), '?')}.{name}": p
            for layer in layers
            for name, p in layer.named_parameters()
            if f".{view}." in f".{name}."
        }


class Blocks(Part):
    name = "blocks"
    lr_key = "block_lr"
    adapts_blocks = True

    def first_block(self, plan: PruningPlan, student: Student) -> int | None:
        return min(adjacent_blocks(plan), default=None)

    def build(self, students: Students, views: list[str]) -> None:
        pruned = students.pruned
        for view in views:
            pruned.substitute_blocks(
                view, {i: plain_copy(pruned.dense_layers[i]) for i in adjacent_blocks(pruned.plan)}
            )

    def params(self, students: Students, view: str, student: Student) -> dict[str, nn.Parameter]:
        """The view's own block copies: its adjacent blocks, or `tail`'s last k."""
        own = students.pruned.blocks[view] if view in students.pruned.blocks else {}
        return {f"blocks.{view}.{index}.{name}": p for index, m in own.items() for name, p in m.named_parameters()}


class Tail(Part):
    name = "tail"
    lr_key = "block_lr"
    fsdp = "refuse"
    adapts_blocks = True

    def first_block(self, plan: PruningPlan, student: Student) -> int | None:
        return min(tail_blocks(plan, student.tail_blocks), default=None)

    def build(self, students: Students, views: list[str]) -> None:
        pruned = students.pruned
        for view in views:
            copies = tail_blocks(pruned.plan, students.specs[view].tail_blocks)
            pruned.substitute_blocks(view, {i: plain_copy(pruned.dense_layers[i]) for i in copies})
            own_modules(students, view, tail_modules(pruned.model))

    def params(self, students: Students, view: str, student: Student) -> dict[str, nn.Parameter]:
        if not student.trains(self.name):
            return {}
        paths = set(tail_modules(students.pruned.model))
        return _own_params(students, view, lambda path: path in paths)

    def settings(self, student: Student | dict) -> dict:
        return {"tail_blocks": student["tail_blocks"] if isinstance(student, dict) else student.tail_blocks}


class Norms(Part):
    name = "norms"
    lr_key = "norm_lr"
    fsdp = "refuse"

    first_block = Lora.first_block  # like the adapters, the norms of every surviving block

    def build(self, students: Students, views: list[str]) -> None:
        for view in views:
            own_modules(students, view, norm_modules(students.pruned, view))

    def params(self, students: Students, view: str, student: Student) -> dict[str, nn.Parameter]:
        """The view's own copies of modules inside the blocks (the norms'; `tail`'s head and norm are not)."""
        pruned = students.pruned
        with pruned.use(DENSE) as model:
            blocks = next(n for n, m in model.named_modules() if m is pruned.stack.layers) + "."
        return _own_params(students, view, lambda path: path.startswith(blocks))


for _part in (Operators(), Lora(), Blocks(), Tail(), Norms()):
    register(_part)
