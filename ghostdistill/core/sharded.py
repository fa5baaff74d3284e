"""FSDP2 from the start: a model that no process holds whole (Lightning's `ModelParallelStrategy`).

`load_sharded` follows the torchtitan / torchtune pattern: the model is built under `accelerate.init_empty_weights`
(parameters on the meta device, buffers such as the rotary frequencies computed as usual), each decoder block is
sharded with `fully_shard` over the mesh, `to_empty` gives every rank storage for its share only, and the weights are
read from the checkpoint's safetensors files tensor by tensor: a block tensor W ∈ R^{r×c} is cut into the mesh's row
chunks (`distribute_tensor(W, mesh, [Shard(0)], src_data_rank=None)`: every rank slices locally, nothing is sent) and
rank k keeps rows [k·⌈r/N⌉, (k+1)·⌈r/N⌉). The files are memory-mapped, so the page cache holds them once for all ranks
of a node and each process's own (anonymous) memory holds at most one tensor beyond its share: a 70B run never has 8
copies of 140 GB in host memory.

Blocks are the sharded units; the embeddings, the final norm, the output head and every operator stay
whole on every rank (replicated): the views call the head outside the decoder (chunked scores) and a model
with tied embeddings uses one weight in both places. For LLaMA-3-70B that is 2 × 128,256 × 8,192 × 2 bytes
= 4.2 GB per rank beside 1/N of the blocks' 137.7 GB.

A sharded block gathers its weights (an all-gather) when its forward starts and frees them when it ends,
so every rank must run the same block forwards in the same order: the phases give every rank the same
number of batches (padding batches are run but not counted) and run single-batch work (the plan
criteria, zero-shot, the analyses) on every rank alike. `fully_shard(..., reshard_after_forward=True)` is
explicit: a unit that is its own root otherwise keeps its weights gathered after its first forward.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .model import ModelConfig, _from_pretrained, decoder_stack, load_model, resolve_torch_dtype

# Hook tables a copy does not carry over: the forward ones (FSDP2's gathers, the views' operator hooks,
# which would act twice) of every module, and an FSDP2 unit's state-dict ones (bound to its process group).
_FORWARD_HOOKS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
_UNIT_HOOKS = (
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _unit() -> type | tuple:
    """FSDP2's unit class, for `isinstance`; the empty tuple (nothing is an instance) where torch has none."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6: no FSDP2 units can exist
        return ()
    return FSDPModule


def plain_class(module: nn.Module) -> type:
    """`module`'s own class: FSDP2 makes a sharded block an instance of ``FSDP<Class>``, a subclass of both."""
    return next(c for c in type(module).__mro__ if not issubclass(c, _unit()))


def is_sharded(module: nn.Module) -> bool:
    """Whether `module` or any of its submodules is an FSDP2 unit."""
    return any(isinstance(m, _unit()) for m in module.modules())


@contextmanager
def gathered(module: nn.Module) -> Iterator[nn.Module]:
    """Within the span, every FSDP2 unit inside `module` holds its whole weights as plain tensors (an
    all-gather: every rank must enter it, in the same order); a plain module as it is."""
    units = [m for m in module.modules() if isinstance(m, _unit())]
    for u in units:
        u.unshard()
    try:
        yield module
    finally:
        for u in units:
            u.reshard()


def _fsdp_key(key: str) -> bool:
    return key.startswith("__composable_api_state_key") or key in ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def plain_copy(module: nn.Module) -> nn.Module:
    """A deep copy of `module` with no hooks (FSDP2's, accelerate's offload hooks, the views' operator hooks) and
    whole, plain tensors (an offloaded module's as they are now: call it with the module onloaded):
    a sharded module's weights are gathered for the copy (collective: every rank calls it). FSDP2 refuses
    `copy.deepcopy` of its units, so the copy is made with their original classes and their FSDP2 state
    and hook tables mapped to nothing."""
    with gathered(module):
        memo: dict[int, object] = {}
        swapped = []
        for m in module.modules():
            if getattr(m, "_hf_hook", None) is not None:  # an offload hook maps every weight of the model: left out
                memo[id(m._hf_hook)] = None
            is_unit = isinstance(m, _unit())
            for name in (*_FORWARD_HOOKS, *(_UNIT_HOOKS if is_unit else ())):
                table = getattr(m, name, None)
                if table is not None:
                    memo[id(table)] = type(table)()
            for key, value in m.__dict__.items():
                if _fsdp_key(key) and not isinstance(value, bool):
                    memo[id(value)] = None
            if is_unit:
                swapped.append((m, type(m)))
                m.__class__ = plain_class(m)
        try:
            clone = copy.deepcopy(module, memo)
        finally:
            for m, cls in swapped:
                m.__class__ = cls
    for m in clone.modules():
        for key in [k for k in m.__dict__ if _fsdp_key(k)]:
            del m.__dict__[key]
        if "_old_forward" in m.__dict__:  # accelerate's wiring: the hook, the wrapped forward, the original
            for attr in ("_hf_hook", "_old_forward", "forward"):
                m.__dict__.pop(attr, None)
    return clone


def reshard_stopped(layers: Sequence[nn.Module]) -> None:
    """Free the weights a block gathered when a forward was stopped by an exception raised in its own
    forward hooks (its post-forward, which frees them, never ran)."""
    for layer in layers:
        if isinstance(layer, _unit()):
            layer.reshard()


# ---------------------------------------------------------------------------------------------- loading
def checkpoint_folder(cfg: ModelConfig) -> Path:
    """The folder of safetensors files every rank reads its share from: a local folder as it is, a hub id's
    snapshot (config and safetensors only), a GGUF file's converted copy in the GGUF cache (made once, by
    rank 0, which dequantises the whole file: GGUF sources are small models). Rank 0 resolves first, the
    others after a barrier, so only one process downloads or converts."""
    first = not dist.is_initialized() or dist.get_rank() == 0
    folder = _resolve(cfg, convert=True) if first else None
    if dist.is_initialized():
        dist.barrier()
    return folder if folder is not None else _resolve(cfg, convert=False)


def _resolve(cfg: ModelConfig, convert: bool) -> Path:
    cached = replace(cfg, cache_gguf=True)
    name, kwargs = _from_pretrained(cached)
    if "gguf_file" in kwargs:
        if not convert:
            raise FileNotFoundError(f"rank 0 did not convert {cfg.source} into the GGUF cache; see its error")
        load_model(cached)  # converts and writes the cache; the model itself is dropped
        name, kwargs = _from_pretrained(cached)
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, revision=cfg.revision, allow_patterns=["*.json", "*.safetensors", "*.py"]))


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise FileNotFoundError(
        f"{folder} holds no safetensors weights (model.safetensors or its index), which FSDP2 loading reads "
        "rank by rank: save the model with save_pretrained (safetensors), or run with ddp or on one device"
    )


@torch.no_grad()
def load_sharded(cfg: ModelConfig, mesh, device: torch.device | str) -> nn.Module:
    """The dense causal LM of `cfg` with every decoder block sharded over `mesh` (the rest replicated) on
    `device`, in eval mode and frozen; no process ever holds the whole model (module docstring)."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = checkpoint_folder(cfg)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code)
    kwargs: dict = {"dtype": resolve_torch_dtype(cfg.dtype), "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    with init_empty_weights():  # parameters on the meta device; buffers computed as usual
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model.eval()
    for block in decoder_stack(model).layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)  # in place: the views keep the same object
    buffers = {name: b.clone() for name, b in model.named_buffers()}  # `to_empty` leaves storage uninitialised
    model.to_empty(device=device)
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
    model.tie_weights()
    files = checkpoint_files(folder)
    missing = [name for name, _ in model.named_parameters() if name not in files]
    if missing:
        raise ValueError(
            f"{folder}: the checkpoint has no tensors {missing[:4]} ({len(missing)} missing) of "
            f"{type(model).__name__}, whose names FSDP2 loading reads as they are: run with ddp or on one device"
        )
    opened: dict[Path, object] = {}
    try:
        for name, param in model.named_parameters():
            if files[name] not in opened:
                opened[files[name]] = safe_open(files[name], framework="pt")
            full = opened[files[name]].get_tensor(name).to(device=device, dtype=param.dtype)
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(full)
            del full
    finally:
        opened.clear()
    model.requires_grad_(False)
    return model
