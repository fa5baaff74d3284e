"""Calibration's shares over several processes: every rank runs as many batches (a sharded model's forwards are
collective), each real batch is counted once, and a padding batch runs but adds nothing to the statistics."""

from __future__ import annotations

import pytest
import torch
from conftest import random_batches, tiny_model

from ghostdistill.calibration.distributed import counted, even_shard
from ghostdistill.calibration.stream import accumulate
from ghostdistill.core.model import decoder_stack
from ghostdistill.core.plan import PruningPlan
from ghostdistill.methods import make_collectors


@pytest.mark.parametrize("n, world", [(5, 2), (7, 3), (4, 2), (1, 2), (2, 4)])
def test_every_rank_runs_as_many_batches_and_each_counts_once(n, world):
    batches = [{"input_ids": torch.full((1, 4), i)} for i in range(n)]
    shares = [even_shard(batches, rank, world) for rank in range(world)]
    assert len({len(s) for s in shares}) == 1 == len({-(-n // world)})
    real = sorted(int(b["input_ids"][0, 0]) for s in shares for b in s if counted(b))
    assert real == list(range(n))


def test_a_padding_batch_runs_and_adds_nothing():
    model = tiny_model("llama", 4)
    gaps = PruningPlan.from_layers([1], 4).gaps
    batches = random_batches(n=2)
    stats = {g.key: make_collectors({"ghost"}, 64, "cpu") for g in gaps}
    padded = {g.key: make_collectors({"ghost"}, 64, "cpu") for g in gaps}
    tokens = accumulate(model, decoder_stack(model), gaps, batches, stats)
    assert accumulate(model, decoder_stack(model), gaps, [*batches, {**batches[0], "counted": False}], padded) == tokens
    one, two = (_flat(s[gaps[0].key]["ghost"].state_dict()) for s in (stats, padded))
    assert one.keys() == two.keys() and any(isinstance(v, torch.Tensor) for v in one.values())
    for key, value in one.items():
        assert torch.equal(two[key], value) if isinstance(value, torch.Tensor) else two[key] == value, key


def _flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in state.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out
