"""A lost step (issue 39): SIGTERM or Ctrl-C during distillation saves the step reached to
`checkpoints/last.ckpt` (not only the last periodic checkpoint), and `--ckpt_path last` continues from it to the
same students, optimizer and best steps as an uninterrupted run of the same steps and batches."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from tiny_run import tiny_run_args

from ghostdistill.cli import main

STEPS = 4


def _args(tiny_dir, text_files, run):
    # checkpoint_every is left at its default (the step count): before this fix, a signal at step 2 of 4 left
    # no checkpoint at all.
    return tiny_run_args(
        tiny_dir,
        text_files,
        run,
        "--model.distill.methods",
        "[ghost]",
        "--model.distill.lr",
        "1e-3",
        "--model.distill.val_every",
        "1",
        "--data.validation.source",
        json.dumps({"source": str(text_files["jsonl_gz"]), "first_document": 150}),
        "--data.validation.num_windows",
        "2",
        "--data.validation.seq_len",
        "32",
        "--trainer.max_steps",
        str(STEPS),
        eval_windows=2,
    )


def _trained(ckpt: dict) -> dict[str, torch.Tensor]:
    """Every trained tensor a checkpoint holds: the students, their optimizer moments, the best states."""
    out = {f"state_dict.{k}": v for k, v in ckpt["state_dict"].items()}
    for view, state in ckpt["ghostdistill"]["students"].items():
        out.update({f"students.{view}.{k}": v for k, v in state.items()})
    for view, best in ckpt["ghostdistill"]["best"].items():
        out.update({f"best.{view}.{k}": v for k, v in best["state"].items()})
    for i, state in ckpt["optimizer_states"][0]["state"].items():
        out.update({f"optimizer.{i}.{k}": v for k, v in state.items() if torch.is_tensor(v)})
    return out


def _same(resumed: dict, reference: dict) -> None:
    assert resumed["global_step"] == reference["global_step"] == STEPS
    a, b = _trained(resumed), _trained(reference)
    assert a.keys() == b.keys() and a
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7, msg=key)
    assert resumed["lr_schedulers"] == reference["lr_schedulers"]
    assert {v: b["step"] for v, b in resumed["ghostdistill"]["best"].items()} == {
        v: b["step"] for v, b in reference["ghostdistill"]["best"].items()
    }


@pytest.mark.parametrize("where", ["sigterm_mid_step", "sigint_in_update"])
def test_resume_a_signal_saves_the_step_reached_and_the_rerun_equals_an_uninterrupted_run(
    where, tiny_dir, text_files, tmp_path, monkeypatch
):
    """`sigterm_mid_step`: SIGTERM inside step 3's forward (2 steps done): saved at step 2. `sigint_in_update`:
    Ctrl-C once step 2's gradients are ready, as the optimizer is about to write the weights: the update
    finishes first, then the run stops and saves step 2. Either way the rerun with `--ckpt_path last` ends
    with the students, optimizer moments, schedule and best steps of 4 steps straight."""
    from ghostdistill.lit.module import GhostDistill

    straight = tmp_path / "straight"
    main(_args(tiny_dir, text_files, straight))
    reference = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=False)
    reference_history = json.loads((straight / "results.json").read_text())["distill"]["history"]

    run = tmp_path / "run"
    previous = signal.getsignal(signal.SIGINT)
    if where == "sigterm_mid_step":
        real = GhostDistill.training_step

        def training_step(self, batch, batch_idx):
            if self.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # raised here, inside the step (`lit.interrupts`)
            return real(self, batch, batch_idx)

        monkeypatch.setattr(GhostDistill, "training_step", training_step)
        expected = (SystemExit,)
    else:
        # pytest-xdist's workers ignore SIGINT; a terminal's Ctrl-C raises KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        real = GhostDistill.on_before_optimizer_step

        def on_before_optimizer_step(self, optimizer):
            if self.global_step == 1:
                os.kill(os.getpid(), signal.SIGINT)  # held until step 2's update is done
            return real(self, optimizer)

        monkeypatch.setattr(GhostDistill, "on_before_optimizer_step", on_before_optimizer_step)
        expected = (KeyboardInterrupt, SystemExit)
    try:
        with pytest.raises(expected):
            main(_args(tiny_dir, text_files, run))
    finally:
        signal.signal(signal.SIGINT, previous)
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 2, "the step reached is saved, whatever distill.checkpoint_every says"
    assert not (run / "results.json").exists()
    monkeypatch.undo()
    main([*_args(tiny_dir, text_files, run), "--ckpt_path", "last"])
    _same(torch.load(run / "checkpoints" / "last.ckpt", weights_only=False), reference)
    history = json.loads((run / "results.json").read_text())["distill"]["history"]
    assert [h["step"] for h in history] == [h["step"] for h in reference_history] == list(range(STEPS + 1))
    for got, want in zip(history, reference_history):
        assert got["ghost_ft"]["kl"] == pytest.approx(want["ghost_ft"]["kl"], rel=1e-6)
