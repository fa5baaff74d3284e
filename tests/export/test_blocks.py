"""Export one block at a time (`export.blocks`): a folded view's state is made block by block, each block once per
pass and only one held, and equals the view folded whole; the safetensors shards written as they fill hold every
tensor under the names `huggingface_hub` gives them."""

from __future__ import annotations

import json

import torch
from conftest import fit_all, tiny_model

from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import copy_block
from ghostdistill.export.blocks import ViewState, save_shards
from ghostdistill.export.writer import view_state
from ghostdistill.methods import GapFit, RecoveryConfig, get_method

METHODS = [RecoveryConfig(name="rt", method="rotation_through"), RecoveryConfig(name="rm", method="replaceme")]


def _folded_whole(pruned, view: str, method: str) -> dict[str, torch.Tensor]:
    """The view's blocks folded as export did before it went block by block: copies of every block at once."""
    plan = pruned.plan
    with pruned.use(view):
        layers = [copy_block(b) for b in pruned.stack.layers]
    by_dense: list = [None] * plan.num_layers
    for new, dense in enumerate(plan.kept):
        by_dense[dense] = layers[new]
    for gap in plan.gaps:
        operators, mlp_maps = dict(pruned.operators[view]), dict(pruned.mlp_maps[view])
        fit = GapFit(operator=operators.get(gap.key), mlp_map=mlp_maps.get(gap.key))
        get_method(method).fold(by_dense, gap, fit)
    return {f"model.layers.{i}.{k}": v for i, block in enumerate(layers) for k, v in block.state_dict().items()}


def test_a_folded_view_is_made_one_block_at_a_time_and_equals_the_whole_fold(tmp_path):
    pruned, _ = fit_all(tiny_model("llama", 6), PruningPlan.from_layers([1, 3], 6), METHODS)
    for view, method in (("rt", "rotation_through"), ("rm", "replaceme")):
        with pruned.use(view):
            state, _, kind = view_state(pruned, view, method, {})
            assert kind == "plain" and isinstance(state, ViewState)
            made: list[int] = []
            state.make = _recording(state.make, made)
            blocks = {name: state[name] for name in state if name.startswith("model.layers.")}
            assert made == list(range(len(pruned.plan.kept))), "each block made once, in order"
            assert len(state._tensors) == len(blocks) // len(made), "only the last block is held"
            for name, tensor in _folded_whole(pruned, view, method).items():
                torch.testing.assert_close(blocks[name], tensor, rtol=0, atol=0, msg=f"{view} {name}")
            assert state.meta(name).shape == tensor.shape and state.meta(name).device.type == "meta"


def _recording(make, made: list[int]):
    def record(i: int):
        made.append(i)
        return make(i)

    return record


def test_shards_are_written_as_they_fill_with_an_index(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(64, 64) for i in range(5)}  # 16 KiB each
    save_shards(state, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert set(index["weight_map"]) == set(state) and index["metadata"]["total_size"] == 5 * 64 * 64 * 4
    loaded = {k: v for f in files for k, v in load_file(tmp_path / f).items()}
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor) and index["weight_map"][name] in files
    quiet = tmp_path / "quiet"
    quiet.mkdir()
    save_shards(state, quiet, max_shard_size="40KB", write=False)  # a rank that gathers and writes nothing
    assert list(quiet.iterdir()) == []
