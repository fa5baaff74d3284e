"""Sharding the students for training with FSDP2 (`fully_shard`, Lightning's `ModelParallelStrategy`).

FSDP2 shards each parameter in place: the decoder blocks stay the same objects, so the views' block
references and operator hooks keep working, and frozen parameters cost no gradient memory. The decoder
blocks are sharded as the model loads (`core.sharded.load_sharded`), before calibration; what is sharded
here is what the students add, each unit one module whose forward is called directly:

- every per-student block copy (made whole from the gathered blocks, then sharded), and any decoder block
  not sharded yet (frozen);
- every trainable gap operator and MLP map (called from the views' hooks).

LoRA adapters (`Part.fsdp` ``replicate``) stay whole on every rank: left out of the units (`ignored_params`),
and injected into an already sharded block they are not FSDP2 parameters at all. Every method's adapter lives
in the same shared block, which each student calls once per step; FSDP2 reduce-scatters a unit's gradients as
a backward leaves one of those calls, and measured on two CPU processes the second student's adapter
gradients were lost (its validation KL never moved). Adapters are small (rank r), so `average_replicated_grads`
averages their gradients across the ranks before each optimizer step, as DDP would.

Embeddings, the final norm and the output head stay replicated: they are frozen, and a model with tied
embeddings calls the same weight as its head outside the decoder.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..core.sharded import is_sharded
from .interface import get_part


def average_replicated_grads(params: list[nn.Parameter], group=None) -> int:
    """Average the gradients of the parameters FSDP2 does not manage (plain tensors, not `DTensor`s) over
    the ranks of `group`, in one flat all-reduce; returns how many were averaged. A no-op on one process."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    grads = [p.grad for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
    return len(grads)


def shard_for_fsdp2(students, mesh) -> tuple[list[nn.Parameter], object, int]:
    """Shard what `students` (a `distill.students.Students`) add over `mesh`; returns the replicated parameters
    (the parts FSDP2 replicates, `Part.fsdp`: LoRA) and their process group (for `average_replicated_grads`) and
    the number of units sharded. The students' parameter lists are refreshed: sharding replaced the parameter
    objects."""
    from torch.distributed.fsdp import fully_shard

    pruned = students.pruned
    if len(pruned.modules_own):
        raise ValueError(
            f"FSDP2 (ModelParallelStrategy) does not shard the students' own head, final norm or norm copies "
            f"(distill.train tail or norms: {list(pruned.modules_own)}) yet; train them with DDP or on one device"
        )
    whole = [
        p
        for view in students.views
        for kind, ps in students.params[view].items()
        if get_part(kind).fsdp == "replicate"
        for p in ps
    ]
    ignored = set(whole)
    blocks = [*pruned.dense_layers, *(block for own in pruned.blocks.values() for block in own.values())]
    operators = []
    for view in students.views:
        for group in (pruned.operators[view], pruned.mlp_maps[view]):
            operators += [op for op in group.values() if any(p.requires_grad for p in op.parameters())]
    units = [(u, True) for u in blocks if not is_sharded(u)] + [(u, None) for u in operators if not is_sharded(u)]
    for unit, reshard in units:
        own = {p for p in unit.parameters() if p in ignored}
        # A block's weights are freed after its forward (explicit: a unit that is its own root keeps them).
        fully_shard(unit, mesh=mesh, ignored_params=own or None, reshard_after_forward=reshard)
    students.refresh_params()
    return whole, mesh.get_group(), len(units)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded (DTensor) parameter; a plain tensor as it is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def ranks_agree(params: list[torch.Tensor], reduce) -> bool:
    """Whether every rank holds the same values of `params` (DDP averages gradients, so a difference is a bug,
    not noise); `reduce(tensor, reduce_op=...)` is the strategy's reduction."""
    check = torch.stack([full_tensor(p).detach().double().sum() for p in params])
    return bool(((reduce(check.clone(), reduce_op="max") - reduce(check.clone(), reduce_op="min")) == 0).all())


def tensor_parallel_refusal(devices) -> str:
    """The one-line fix for a `ModelParallelStrategy` that would split the processes into tensor-parallel ranks."""
    n = devices if isinstance(devices, int) else "N"
    return (
        "ModelParallelStrategy: ghostdistill shards every phase with FSDP2 over all processes and runs no tensor "
        f"parallelism: set init_args.data_parallel_size: {n} (the number of processes, trainer.devices × "
        "num_nodes) and tensor_parallel_size: 1"
    )


def shard_mesh(device_mesh):
    """The mesh FSDP2 shards over: the data-parallel dimension of `ModelParallelStrategy`'s mesh, which must
    span every process (ghostdistill runs no tensor parallelism)."""
    names = device_mesh.mesh_dim_names or ()
    mesh = device_mesh["data_parallel"] if "data_parallel" in names else device_mesh
    if mesh.size() != device_mesh.size():
        raise ValueError(tensor_parallel_refusal(device_mesh.size()))
    return mesh
