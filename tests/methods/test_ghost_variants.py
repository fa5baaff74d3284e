"""The ghost fit options (`first_normed`, `bias`, `scale`), the symmetric-constrained method,
and `objective`, each against a direct computation on the tokens."""

import pytest
import torch
from conftest import fit_all, random_batches, tiny_model

from ghostdistill.core.plan import Gap, PruningPlan
from ghostdistill.methods import GapTaps, RecoveryConfig, validate_recovery
from ghostdistill.methods.ghost import GhostStatistics, fit_ghost, objective

C = 8


def _taps(seed: int = 0) -> GapTaps:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 40, C, generator=g) * 3
    x[:, 0] *= 30  # a massive first position
    m = torch.randn(C, C, generator=g) * 0.3
    post = x + x @ m + 0.5 + 0.1 * torch.randn(3, 40, C, generator=g)
    mask = torch.ones(3, 40)
    mask[2, 30:] = 0  # padding is ignored
    first = torch.zeros(3, 40, dtype=torch.bool)
    first[:, 0] = True
    return GapTaps(x, post, mask, first)


def _rest_tokens(taps: GapTaps) -> tuple[torch.Tensor, torch.Tensor]:
    keep = taps.mask.bool() & ~taps.first
    x = taps.x_pre[keep].double()
    return x, taps.x_post[keep].double() - x


def _stats(taps: GapTaps) -> GhostStatistics:
    stats = GhostStatistics(C)
    stats.update(taps)
    return stats


def test_bias_is_the_affine_least_squares_fit():
    taps = _taps()
    op = fit_ghost(RecoveryConfig(fit="first", bias=True, solver="lstsq"), Gap(1, 3), _stats(taps))
    x, d = _rest_tokens(taps)
    aug = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], 1)
    expected = torch.linalg.lstsq(aug, d).solution
    torch.testing.assert_close(op.delta.double(), expected[:-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(op.bias.double(), expected[-1], rtol=1e-5, atol=1e-5)
    assert op.inference_parameters() == C * C + 2 * C
    # Applied: ordinary tokens get x + x·M + c, first positions x + b.
    out = op(taps.x_pre, taps.first)
    torch.testing.assert_close(out[:, 1:], taps.x_pre[:, 1:] @ (op.delta + torch.eye(C)) + op.bias)
    torch.testing.assert_close(out[:, 0], taps.x_pre[:, 0] + op.first_shift)


def test_normed_fit_weighs_by_the_output_norm():
    taps = _taps(1)
    op = fit_ghost(RecoveryConfig(fit="first_normed", solver="lstsq"), Gap(1, 3), _stats(taps))
    x, d = _rest_tokens(taps)
    w = 1.0 / (x + d).norm(dim=1, keepdim=True)
    expected = torch.linalg.lstsq(x * w, d * w).solution
    torch.testing.assert_close(op.delta.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_norm_scale_matches_the_target_energy(bias):
    taps = _taps(2)
    op = fit_ghost(RecoveryConfig(fit="first", scale="norm", bias=bias), Gap(1, 3), _stats(taps))
    x, d = _rest_tokens(taps)
    pred = x @ (op.delta.double() + torch.eye(C, dtype=torch.float64))
    if bias:
        pred = pred + op.bias.double()
    torch.testing.assert_close(pred.pow(2).sum(), (x + d).pow(2).sum(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("fit", ["first", "first_weighted", "plain"])
def test_objective_equals_the_error_on_the_tokens(fit):
    taps = _taps(3)
    stats = _stats(taps)
    cfg = RecoveryConfig(fit=fit, bias=fit == "first")
    op = fit_ghost(cfg, Gap(1, 3), stats)
    weighting = {"first": "plain", "first_weighted": "weighted", "plain": "plain"}[fit]
    include_first = fit == "plain"
    delta = op.delta.detach().double()
    bias = op.bias.detach().double() if op.bias is not None else None
    err, base = objective(stats, delta, bias, weighting, include_first)
    keep = taps.mask.bool() & (torch.ones_like(taps.first) if include_first else ~taps.first)
    x = taps.x_pre[keep].double()
    d = taps.x_post[keep].double() - x
    w = torch.ones(len(x), 1, dtype=torch.float64)
    if weighting == "weighted":
        w = 1.0 / torch.maximum(x.norm(dim=1), (x + d).norm(dim=1)).unsqueeze(1)
    resid = x @ delta + (bias if bias is not None else 0) - d
    torch.testing.assert_close(
        torch.tensor(err, dtype=torch.float64),
        (resid * w).pow(2).sum(),
        rtol=1e-6,
        atol=1e-8,
    )
    torch.testing.assert_close(torch.tensor(base, dtype=torch.float64), (d * w).pow(2).sum(), rtol=1e-9, atol=0)


def test_symmetric_method_fits_a_symmetric_operator_no_better_than_ghost():
    taps = _taps(4)
    stats = _stats(taps)
    free = fit_ghost(RecoveryConfig(), Gap(1, 3), stats)
    sym = fit_ghost(RecoveryConfig(), Gap(1, 3), stats, symmetric=True)
    torch.testing.assert_close(sym.delta, sym.delta.T, rtol=0, atol=0)
    e_free, _ = objective(stats, free.delta.detach().double(), None, "weighted", False)
    e_sym, _ = objective(stats, sym.delta.detach().double(), None, "weighted", False)
    assert e_sym > e_free
    torch.testing.assert_close(sym.first_shift, free.first_shift)  # same first-position map


@torch.no_grad()
def test_variants_run_through_the_registry_as_views():
    model = tiny_model("llama", num_layers=6)
    plan = PruningPlan.from_layers([2, 3], 6)
    methods = [
        RecoveryConfig(name="ghost"),
        RecoveryConfig(name="b", bias=True, scale="norm", fit="first_normed"),
        RecoveryConfig(name="sym", method="ghost_symmetric"),
    ]
    validate_recovery(methods)
    pm, _ = fit_all(model, plan, methods)
    ids = random_batches(1, seed=4)[0]["input_ids"]
    outs = {}
    for cfg in methods:
        with pm.use(cfg.name) as m:
            outs[cfg.name] = m(ids).logits
    assert not torch.allclose(outs["ghost"], outs["b"])
    assert not torch.allclose(outs["ghost"], outs["sym"])


def test_bad_scale_is_named_and_old_statistics_are_refused():
    with pytest.raises(ValueError, match="scale 'energy'"):
        validate_recovery([RecoveryConfig(name="x", scale="energy")])
    stats = GhostStatistics(C)
    old = stats.state_dict()
    old.pop("xsum")
    with pytest.raises(ValueError, match="older version"):
        GhostStatistics(C).load_state_dict(old)
