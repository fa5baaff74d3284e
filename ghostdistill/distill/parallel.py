"""Sharding the students for training with FSDP2 (`fully_shard`, Lightning's `ModelParallelStrategy`).

FSDP2 shards each parameter in place: the decoder blocks stay the same objects, so the views' block
references and operator hooks keep working, and frozen parameters cost no gradient memory. Each unit
is one module whose forward is called directly:

- every decoder block (frozen, with its LoRA adapters when they train) and every per-student block copy;
- every trainable gap operator and MLP map (called from the views' hooks).

Embeddings, the final norm and the output head stay replicated: they are frozen, and a model with tied
embeddings calls the same weight as its head outside the decoder. Calibration runs before sharding,
on the whole model, each rank streaming its share of the windows.
"""

from __future__ import annotations

from torch import nn

from ..core.views import PrunedModel


def shard_students(pruned: PrunedModel, views: list[str], mesh) -> int:
    """Apply `fully_shard` to the units above over `mesh`; returns how many units were sharded."""
    from torch.distributed.fsdp import fully_shard

    units: list[nn.Module] = list(pruned.dense_layers)
    for own in pruned.blocks.values():
        units += list(own.values())
    for view in views:
        for group in (pruned.operators[view], pruned.mlp_maps[view]):
            units += [op for op in group.values() if any(p.requires_grad for p in op.parameters())]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    return len(units)
