"""Files left by an earlier run: a corrupt, truncated, older-format or foreign calibration state, zero-shot
score or distillation checkpoint is detected, reported and recomputed, never loaded into a wrong model;
and the same config and seed give bit-identical operators."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_run import tiny_run_args

from ghostdistill.calibration.state import STATE_FILE, STATE_FORMAT, load_state
from ghostdistill.cli import main
from ghostdistill.lit.checkpoint import checkpoint_problem
from ghostdistill.methods import make_collectors

ROOT = Path(__file__).resolve().parents[2]


def _args(tiny_dir, text_files, run, *extra):
    recovery = [{"name": "ghost"}, {"name": "linearpatch", "method": "linearpatch"}]
    return tiny_run_args(
        tiny_dir,
        text_files,
        run,
        "--calibration.checkpoint_every",
        "1",
        *extra,
        recovery=recovery,
    )


def _operators(cli) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in cli.model.run.pruned.operators.state_dict().items()}


@pytest.mark.slow  # five tiny runs, about 45 s on 2 cores
def test_same_config_and_seed_give_bit_identical_operators_and_bad_states_are_recomputed(
    tiny_dir, text_files, tmp_path, caplog
):
    first = _operators(main(_args(tiny_dir, text_files, tmp_path / "a")))
    second = _operators(main(_args(tiny_dir, text_files, tmp_path / "b")))
    assert first.keys() == second.keys() and len(first) >= 2
    for key in first:
        assert torch.equal(first[key], second[key]), f"{key} differs between two runs of the same config"

    state = tmp_path / "a" / STATE_FILE
    good = state.read_bytes()
    for label, damage in [
        ("truncated", lambda: state.write_bytes(good[: len(good) // 2])),
        ("garbage", lambda: state.write_bytes(b"not a torch file at all")),
        (
            "older format",
            lambda: torch.save(
                {k: v for k, v in torch.load(state, weights_only=True).items() if k != "format"},
                state,
            ),
        ),
    ]:
        state.write_bytes(good)
        damage()
        with pytest.warns(UserWarning, match=rf"{STATE_FILE} .*calibrating from scratch"):
            again = _operators(main(_args(tiny_dir, text_files, tmp_path / "a")))
        for key in first:
            assert torch.equal(first[key], again[key]), f"{label}: {key}"
        assert torch.load(state, weights_only=True)["format"] == STATE_FORMAT, f"{label}: the file was rewritten"


def _state(hidden: int = 8, **change) -> dict:
    stats = {name: c.state_dict() for name, c in make_collectors({"ghost"}, hidden, "cpu").items()}
    state = {
        "format": STATE_FORMAT,
        "fingerprint": "abc",
        "plan": {
            "num_layers": 6,
            "removed": (2, 3),
            "chosen_by": "explicit",
            "scores": {},
        },
        "stats": {"2-3": stats},
        "batches_done": 2,
        "batches_total": 4,
        "tokens": 100,
    }
    state.update(change)
    return state


@pytest.mark.parametrize(
    "state, why",
    [
        (
            _state(fingerprint="other"),
            None,
        ),  # other settings: recomputed, said in the log
        (_state(format=None), "of format None; this version writes format 2"),
        (_state(batches_done=5), "batches_done 5 of 4"),
        (_state(stats={}), r"statistics for gaps \[\], plan gaps \['2-3'\]"),
        (
            _state(hidden=16),
            r"gap 2-3 ghost.xtx.plain_rest: shape torch.Size\(\[16, 16\]\), expected \(8, 8\)",
        ),
        ([1, 2, 3], "holds a list, not a calibration state"),
        # Saved before a collector gained a sum: the same settings, discarded by its layout.
        (
            _state(
                stats={"2-3": {"ghost": {k: v for k, v in _state()["stats"]["2-3"]["ghost"].items() if k != "xtx"}}}
            ),
            r"gap 2-3 ghost: entries",
        ),
    ],
)
def test_unusable_calibration_states_are_named_and_not_loaded(state, why, tmp_path):
    path = tmp_path / "calibration_state.pt"
    torch.save(state, path)
    if why is None:
        assert load_state(path, "abc", {"ghost"}, 8) is None
        return
    with pytest.warns(UserWarning, match=why):
        assert load_state(path, "abc", {"ghost"}, 8) is None


def test_non_finite_and_readable_states(tmp_path):
    path = tmp_path / "calibration_state.pt"
    torch.save(_state(), path)
    assert load_state(path, "abc", {"ghost"}, 8).batches_done == 2
    bad = _state()
    bad["stats"]["2-3"]["ghost"]["xtx"]["plain_rest"][0, 0] = float("nan")
    torch.save(bad, path)
    with pytest.warns(UserWarning, match="plain_rest is not finite"):
        assert load_state(path, "abc", {"ghost"}, 8) is None
    # Methods that collect other statistics than the file holds.
    torch.save(_state(), path)
    with pytest.warns(UserWarning, match="expected \\['ghost', 'linearpatch'\\]"):
        assert load_state(path, "abc", {"ghost", "linearpatch"}, 8) is None


def test_checkpoint_problems_are_named(tmp_path):
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}, "global_step": 2, "ghostdistill": {"students": {}}}, path)
    assert checkpoint_problem(path) is None
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    assert checkpoint_problem(path).startswith("cannot be read")
    torch.save({"state_dict": {}, "global_step": 2, "ghostdistill": {}}, path)
    assert "not written by this version of ghostdistill" in checkpoint_problem(path)
    # Anything but tensors and plain data (a pickled object runs code when loaded): never loaded.
    torch.save({"state_dict": {}, "global_step": 2, "ghostdistill": {"students": {}}, "x": Path("p")}, path)
    assert checkpoint_problem(path).startswith("cannot be read with weights_only=True")
    torch.save([1], path)
    assert checkpoint_problem(path) == "is not a Lightning checkpoint"
