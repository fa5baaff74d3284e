"""Export one block at a time (`export.pieces`): a folded view's pieces are made block by block and equal the view
folded whole; a rank that only joins the gathers (`write` false) writes nothing."""

from __future__ import annotations

import torch
from conftest import fit_all, tiny_model

from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.sharded import plain_copy
from ghostdistill.export.pieces import view_pieces
from ghostdistill.export.writer import export_view
from ghostdistill.methods import GapFit, RecoveryConfig, get_method

METHODS = [RecoveryConfig(name="rt", method="rotation_through"), RecoveryConfig(name="rm", method="replaceme")]


def _folded_whole(pruned, view: str, method: str) -> dict[str, torch.Tensor]:
    """The view's blocks folded as export did before it went block by block: copies of every block at once."""
    plan = pruned.plan
    with pruned.use(view):
        layers = [plain_copy(b) for b in pruned.stack.layers]
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
            pieces, _, kind = view_pieces(pruned, view, method, {})
            assert kind == "plain"
            blocks = [p for p in pieces if any(n.startswith("model.layers.") for n in p.names)]
            assert len(blocks) == len(pruned.plan.kept), "one piece per kept block"
            made = {}
            for i, piece in enumerate(blocks):
                tensors = piece.load()
                assert set(tensors) == set(piece.names) and all(n.startswith(f"model.layers.{i}.") for n in tensors)
                made.update(tensors)
            whole = _folded_whole(pruned, view, method)
            assert set(made) == set(whole)
            for name, tensor in whole.items():
                torch.testing.assert_close(made[name], tensor, rtol=0, atol=0, msg=f"{view} {name}")
        quiet = tmp_path / view
        assert export_view(pruned, view, quiet, method=method, write=False) == quiet  # a rank that only gathers
        assert not quiet.exists() and list(tmp_path.iterdir()) == []
