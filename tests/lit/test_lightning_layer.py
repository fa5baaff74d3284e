"""The Lightning layer: what the module registers, what the data module caches, and who writes."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import tiny_model
from tiny_run import tiny_run_args

from ghostdistill.cli import main
from ghostdistill.core.model import ModelConfig
from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import PrunedModel
from ghostdistill.lit.module import GhostDistill
from ghostdistill.methods import RecoveryConfig, identity_fit
from ghostdistill.planning import PlanConfig

ROOT = Path(__file__).resolve().parents[2]


def _args(model_dir, text_files, run, *extra):
    # The config's recovery and (data-free) calibration source: 4 windows of 16 tokens.
    return tiny_run_args(
        model_dir,
        text_files,
        run,
        *extra,
        recovery=None,
        calibration_source=False,
        samples=4,
        seq_len=16,
        batch_size=None,
    )


def test_every_methods_maps_are_registered_children(tiny_dir):
    """ReplaceMe's MLP maps reach parameters() (so an optimizer) and state_dict() (so checkpoints)."""
    module = GhostDistill(
        model=ModelConfig(source=str(tiny_dir)),
        plan=PlanConfig(layers=[2, 3]),
        recovery=[RecoveryConfig(name="rm", method="replaceme"), RecoveryConfig(name="g")],
    )
    module.configure_model()
    pruned = PrunedModel(module.llm, PruningPlan.from_layers([2, 3], 6))
    module.attach(pruned)
    for cfg in module.cfg.recovery:
        fit = identity_fit(cfg, 64)
        pruned.add_method(
            cfg.name, {"2-3": fit.operator} if fit.operator else {}, {"2-3": fit.mlp_map} if fit.mlp_map else {}
        )
    keys = set(module.state_dict())
    assert "mlp_maps.rm.2-3.delta" in keys and "operators.g.2-3.delta" in keys
    params = {id(p) for p in module.parameters()}
    assert id(pruned.mlp_maps["rm"]["2-3"].delta) in params
    assert id(pruned.operators["g"]["2-3"].delta) in params


def test_generated_calibration_text_is_kept_per_model(tiny_dir, tiny_tokenizer, text_files, tmp_path):
    """Two models in one run folder: each generates (and caches) its own text; neither reuses the other's. (A run
    of other settings replaces the folder's results only with `--overwrite_run true`.)"""
    other = tmp_path / "other_model"
    tiny_model("llama", num_layers=6, seed=1).save_pretrained(other)
    tiny_tokenizer.save_pretrained(other)
    run = tmp_path / "run"
    main(_args(tiny_dir, text_files, run))
    first = sorted(run.glob("generated_calibration_*.pt"))
    main([*_args(other, text_files, run), "--overwrite_run", "true"])
    both = sorted(run.glob("generated_calibration_*.pt"))
    assert len(first) == 1 and len(both) == 2
    texts = [torch.load(p) for p in both]
    assert not torch.equal(texts[0], texts[1])  # another model samples other text from the same seed
    # The first model's cache is still what it wrote, and a rerun of that model reuses it.
    before = first[0].stat().st_mtime_ns
    main([*_args(tiny_dir, text_files, run), "--overwrite_run", "true"])
    assert first[0].stat().st_mtime_ns == before and len(list(run.glob("generated_calibration_*.pt"))) == 2


def test_only_rank_zero_writes(tiny_dir, text_files, tmp_path, monkeypatch):
    """A process that is not rank 0 computes everything but writes no file."""
    from lightning.pytorch import Trainer

    monkeypatch.setattr(Trainer, "is_global_zero", property(lambda self: False))
    run = tmp_path / "run"
    main(_args(tiny_dir, text_files, run, "--calibration.checkpoint_every", "1"))
    written = sorted(p.name for p in run.rglob("*") if p.is_file()) if run.exists() else []
    # LightningCLI saves config.yaml on rank 0 only as well.
    assert written == [], written
