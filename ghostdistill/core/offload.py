"""Weights off the compute device: a model larger than the device's memory, brought on one block at a time.

`model.model.offload` picks where the weights live between their turns:

- ``none``: on the compute device, the whole model (the default);
- ``cpu``: in host memory. accelerate's `cpu_offload`: a state dict on the CPU holds every tensor, the
  modules' parameters sit on the meta device, and each module's tensors are put on the device for its forward;
- ``disk``: in the checkpoint's own safetensors files, read when needed. transformers'
  `from_pretrained(device_map={"": "disk"}, offload_folder=...)`, which is accelerate's disk offload reading
  the checkpoint's files where they are (a checkpoint in another format is re-saved into `offload_folder`
  once; a GGUF file is converted into ghostdistill's cache first, `cache_gguf`).

The hooks alone load a module for each of its forwards: a pass over 32 batches would read every block 32
times. The passes that matter (calibration statistics, the sequential fits, the repair criteria's scoring,
evaluation, the analyses, export) therefore go block by block (`core.sequential`): `onloaded(block)` brings
a block's tensors onto the device once (the hook's own onload, with its offload paused, as accelerate's
`align_module_device` does), every window goes through it, and it is dropped before the next block comes.
Other passes (zero-shot, data-free generation) still work, through the hooks, at one load per forward.

The compute device is the one the hooks execute on (`model_device`): the CPU here, a GPU when given one
(`load_model(cfg, device)`); with ``disk`` on a GPU the final norm stays on it, which makes it accelerate's
main device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal, get_args

import torch
from torch import nn

Offload = Literal["none", "cpu", "disk"]
OFFLOAD_MODES = get_args(Offload)
# Set on a model loaded with its weights off the device: the mode and the device its hooks execute on.
_MODE, _DEVICE = "ghostdistill_offload", "ghostdistill_device"


def offload_mode(model: nn.Module) -> str:
    return getattr(model, _MODE, "none")


def is_offloaded(model: nn.Module) -> bool:
    return offload_mode(model) != "none"


def model_device(model: nn.Module) -> torch.device:
    """The device a model computes on: its hooks' execution device when its weights are offloaded (they sit
    on the meta device between turns), else its parameters'."""
    device = getattr(model, _DEVICE, None)
    return torch.device(device) if device is not None else next(model.parameters()).device


def offload_to_cpu(model: nn.Module, device: torch.device) -> nn.Module:
    """A model loaded in host memory, its weights kept there and brought to `device` module by module."""
    from accelerate import cpu_offload

    cpu_offload(model, execution_device=device)
    return _mark(model, "cpu", device)


def load_from_disk(auto_class, name: str, kwargs: dict, folder: str, device: torch.device, keep: str | None):
    """`auto_class.from_pretrained(name, **kwargs)` with every weight on the disk (accelerate's disk offload
    through transformers): the safetensors files are read a module at a time. `keep`: a module (the final norm)
    left on `device` when that is not the CPU, so that accelerate executes there."""
    device_map: dict[str, str | torch.device] = {"": "disk"}
    if device.type != "cpu" and keep:
        device_map[keep] = device
    model = auto_class.from_pretrained(name, device_map=device_map, offload_folder=folder, **kwargs)
    return _mark(model, "disk", device)


def _mark(model: nn.Module, mode: str, device: torch.device) -> nn.Module:
    setattr(model, _MODE, mode)
    setattr(model, _DEVICE, str(device))
    return model


def _offload_hooks(module: nn.Module) -> Iterator[tuple[nn.Module, object]]:
    """(submodule, accelerate `AlignDevicesHook` that offloads it) under `module`."""
    for sub in module.modules():
        hook = getattr(sub, "_hf_hook", None)
        for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
            if getattr(h, "offload", False) and hasattr(h, "weights_map"):
                yield sub, h


@contextlib.contextmanager
def onloaded(*modules: nn.Module) -> Iterator[None]:
    """The tensors of `modules` on the compute device for the whole block, each loaded once (their hooks'
    offload paused, so that forwards inside do not load them again), and dropped at the end. A module that is
    not offloaded, or already on (an outer `onloaded`), is left as it is."""
    held: list[tuple[nn.Module, object]] = []
    try:
        for module in modules:
            for sub, hook in _offload_hooks(module):
                hook.pre_forward(sub)
                hook.offload = False
                held.append((sub, hook))
        yield
    finally:
        for sub, hook in reversed(held):
            hook.offload = True
            hook.post_forward(sub, None)


def offloaded_tied_copies(model: nn.Module) -> set[str]:
    """Names of the parameters that are a tied weight's second name (the output head tied to the embedding)
    on an offloaded model. In memory a tied weight is one parameter under two names (`named_parameters` yields
    it once); offloaded, accelerate gives each module its own placeholder on the meta device around every
    forward, so after the first pass one checkpoint tensor shows as two parameters, and a count of them would
    add the embedding twice. A copy that holds values of its own (a view's own head) is not one of these."""
    if not is_offloaded(model):
        return set()
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    config = getattr(model, "config", None)
    if not tied and getattr(getattr(config, "get_text_config", lambda: config)(), "tie_word_embeddings", False):
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if head is not None and embedding is not None and id(head.weight) in names:
            tied = {names[id(head.weight)]: names.get(id(embedding.weight))}
    params = dict(model.named_parameters())
    return {
        target
        for target, source in tied.items()
        if target in params and source in params and params[target].is_meta and params[source].is_meta
    }


def materialised(module: nn.Module) -> bool:
    """Whether any of the module's parameters holds values (is not on the meta device)."""
    return any(p.device.type != "meta" for p in module.parameters())
