"""A view's weights one block at a time: what lets export write a model that no process holds whole.

    state = ViewState(eager, blocks, make)     the view's state dict; block i's tensors are made by `make(i)`
                                               the first time one of them is read, and dropped when another
                                               block's are
    save_shards(state, folder)                 safetensors shards written as they fill, and their index

`make(i)` is where a block's whole tensors come from: the live block's own tensors in one process; under FSDP2
(`core.sharded`) a copy gathered from every rank's share (`copy_block`, collective), LoRA merged and a fold
applied to that one block (every fold is block by block: a block's transform depends on its own weights and
the gaps' fits only). Readers go through the keys in order (the state dict's, block after block), so host
memory holds one block, plus the shard being filled (`max_shard_size`), plus the eager tensors (embeddings,
final norm, head, operators), whatever the depth.

Several processes export together when the model is sharded: every rank reads the same tensors in the same
order (each block's gather is a collective) and only rank 0 writes (`write`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from pathlib import Path

import torch


class ViewState(MutableMapping[str, torch.Tensor]):
    """A state dict whose block tensors are made on first read, one block at a time (module docstring).

    `eager`: the other tensors, by name, in order; `blocks`: for each block, its tensors' names in the state
    dict (in order) and their shapes and dtypes, as `torch.empty(..., device="meta")` tensors keyed by the
    name within the block; `make(i)`: block i's tensors by their name within the block. The names are in the
    order `eager`'s come in, then each block's; `order` gives another (the model's state dict order)."""

    def __init__(
        self,
        eager: dict[str, torch.Tensor],
        blocks: list[dict[str, tuple[str, torch.Tensor]]],
        make: Callable[[int], Mapping[str, torch.Tensor]],
        order: list[str] | None = None,
    ) -> None:
        self.eager, self.make = dict(eager), make
        self.where = {name: (i, local, meta) for i, b in enumerate(blocks) for name, (local, meta) in b.items()}
        self.order = [n for n in (order or [*eager, *self.where]) if n in self.eager or n in self.where]
        self._block: int | None = None
        self._tensors: Mapping[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.eager:
            return self.eager[name]
        i, local, _ = self.where[name]
        if i != self._block:
            self._tensors, self._block = {}, None  # the previous block goes before the next one comes
            self._tensors, self._block = self.make(i), i
        return self._tensors[local]

    def meta(self, name: str) -> torch.Tensor:
        """The tensor's shape and dtype without making it (a meta tensor)."""
        if name in self.eager:
            return torch.empty(self.eager[name].shape, dtype=self.eager[name].dtype, device="meta")
        return self.where[name][2]

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self.where.pop(name, None)
        if name not in self.eager:
            self.order.append(name)
        self.eager[name] = tensor

    def __delitem__(self, name: str) -> None:
        if name not in self.eager and name not in self.where:
            raise KeyError(name)
        self.eager.pop(name, None)
        self.where.pop(name, None)
        self.order.remove(name)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.order))

    def __len__(self) -> int:
        return len(self.order)

    def renamed(self, prefix: str) -> ViewState:
        """The same state with every name prefixed (a wrapper's names), nothing made."""
        out = ViewState({prefix + k: v for k, v in self.eager.items()}, [], self.make)
        out.where = {prefix + k: v for k, v in self.where.items()}
        out.order = [prefix + n for n in self.order]
        return out


def save_shards(
    state: Mapping[str, torch.Tensor], folder: Path, max_shard_size: str = "5GB", write: bool = True
) -> None:
    """`state` as safetensors shards in `folder` (`model.safetensors`, or `model-0000k-of-0000n.safetensors` and
    `model.safetensors.index.json`), the names as `huggingface_hub.save_torch_state_dict` gives them; a shard
    is written as soon as its tensors are made. `write` false: every tensor is made (the gathers of a sharded
    model, in rank 0's order) and nothing is written."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    metas = {k: state.meta(k) if isinstance(state, ViewState) else state[k] for k in state}
    split = split_torch_state_dict_into_shards(metas, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        shard = {name: state[name].detach().to("cpu").contiguous() for name in names}
        if write:
            save_file(shard, str(folder / filename), metadata={"format": "pt"})
        del shard
    if write and split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
