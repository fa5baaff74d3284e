"""Repair-aware planning (`ghostdistill.planning`): `repair` picks the block the repair fixes best, not the
one with the highest cosine; `repair_greedy` at n = 1 is `repair`; candidate statistics are a single-plan
calibration's; the caches change nothing but the number of passes."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_batches, tiny_model
from torch import nn

from ghostdistill.calibration.stream import accumulate
from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import PRUNED, PrunedModel
from ghostdistill.methods import RecoveryConfig, make_collectors
from ghostdistill.planning import (
    PlanConfig,
    PlanInputs,
    RepairFitter,
    SelectionScorer,
    check_plan,
    choose,
    get_criterion,
    repair_config,
    repair_greedy_plan,
    repair_plan,
)

PLAIN = RecoveryConfig(name="ghost_paper", method="ghost", fit="plain")


class LinearBlock(nn.Module):
    """A decoder block that is exactly linear in its input: x ↦ x·A (A a scaled rotation, so the residual
    stream turns far: a low cosine, yet a linear repair undoes it exactly)."""

    def __init__(self, hidden: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=g))
        self.register_buffer("a", 1.5 * q)

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states @ self.a


def built_model(linear: int = 2, quiet: int = 4):
    """A tiny LLaMA of 7 blocks: block `linear` exactly linear (low cosine), block `quiet` a real block whose
    residual branches are scaled down to 2% (the highest cosine, but a nonlinear change no linear map undoes);
    the head scaled up so that next-token distributions are peaked and KL separates candidates."""
    model = tiny_model("llama", num_layers=7, seed=3)
    layers = model.model.layers
    layers[linear] = LinearBlock(64, seed=1)
    with torch.no_grad():
        layers[quiet].self_attn.o_proj.weight.mul_(0.02)
        layers[quiet].mlp.down_proj.weight.mul_(0.02)
        model.lm_head.weight.mul_(4.0)
    return model.eval()


def inputs(model, batches, selection, **kw) -> PlanInputs:
    """What `repair_plan` and `repair_greedy_plan` read, for `model` (its own decoder stack)."""
    return PlanInputs(model, model.model, batches, selection=selection, **kw)


def selection_batches():
    return random_batches(n=2, batch=4, seq=32, seed=99)


def test_repair_chooses_the_exactly_repairable_block_and_streamline_the_most_similar():
    model = built_model()
    batches = random_batches(n=4)
    streamline = choose(PlanConfig(num_layers=1), model, batches)
    assert streamline.removed == (4,)
    cfg = PlanConfig(criterion="repair", num_layers=1, repair_method="ghost_paper")
    plan = choose(cfg, model, batches, recovery=[PLAIN], selection=selection_batches())
    assert plan.removed == (2,)
    rows = plan.candidates
    assert set(rows) == {f"{i}-{i}" for i in range(1, 6)}  # keep_first = keep_last = 1
    # The linear block is repaired to round-off; the quiet one keeps most of its (small) pruned KL.
    assert rows["2-2"]["repaired_kl"] < 1e-4 < rows["2-2"]["pruned_kl"]
    assert rows["4-4"]["pruned_kl"] < rows["2-2"]["pruned_kl"]
    assert rows["4-4"]["repaired_kl"] > 10 * rows["2-2"]["repaired_kl"]
    assert max(rows, key=lambda k: rows[k]["cosine"]) == "4-4"
    assert plan.scores == {k: r["repaired_kl"] for k, r in rows.items()}
    assert plan.costs["candidates"] == 5 and plan.costs["dense_passes"] == 1
    assert plan.chosen_by == "repair (ghost_paper)"


def test_repair_with_no_recovery_method_scores_the_pruned_model():
    model = built_model()
    batches = random_batches(n=2)
    cfg = PlanConfig(criterion="repair", num_layers=1, repair_method="none")
    plan = choose(cfg, model, batches, recovery=[PLAIN], selection=selection_batches())
    rows = plan.candidates
    for row in rows.values():
        assert row["repaired_kl"] == pytest.approx(row["pruned_kl"], rel=1e-6)
    assert plan.removed == (min(rows.values(), key=lambda r: r["pruned_kl"])["start"],)


def test_greedy_at_one_block_is_repair_at_one_block():
    model = built_model()
    batches = random_batches(n=3)
    cfg = PlanConfig(criterion="repair", num_layers=1)
    contiguous = repair_plan(cfg, PLAIN, inputs(model, batches, selection_batches()))
    greedy = repair_greedy_plan(cfg, PLAIN, inputs(model, batches, selection_batches()))
    assert greedy.removed == contiguous.removed
    tried = greedy.candidates["step 1"]["tried"]
    assert {int(b): kl for b, kl in tried.items()} == {
        r["start"]: r["repaired_kl"] for r in contiguous.candidates.values()
    }


def test_greedy_builds_a_plan_block_by_block_and_reuses_fits():
    model = built_model()
    batches = random_batches(n=2)
    cfg = PlanConfig(criterion="repair_greedy", num_layers=3)
    plan = repair_greedy_plan(cfg, PLAIN, inputs(model, batches, selection_batches()))
    assert len(plan.removed) == 3 and plan.removed[0] != 0 and plan.removed[-1] != 6
    steps = plan.candidates
    assert [steps[f"step {t}"]["kept"] for t in (1, 2, 3)] == [int(b) for b in plan.scores]
    assert 2 in plan.removed  # the exactly repairable block goes first
    assert steps["step 1"]["kept"] == 2
    # Each step tries every removable block not yet removed, and keeps the lowest KL.
    for t, left in ((1, 5), (2, 4), (3, 3)):
        tried = steps[f"step {t}"]["tried"]
        assert len(tried) == left
        assert steps[f"step {t}"]["kl"] == min(tried.values())
    assert plan.costs["dense_passes"] <= 3
    # Sequential fits: a student pass only for a gap after the first; never more than one per candidate
    # and gap at or after the changed one.
    assert plan.costs["student_passes"] <= 4 * 1 + 3 * 2
    assert plan.costs["selection_forwards"] == 5 + 4 + 3


def test_greedy_from_the_steps_of_another_depth_is_the_search_from_scratch():
    """The search is deterministic, so the steps of a shallower run are a deeper run's first ones: starting
    after them gives the plan and the later steps' KLs of the search from scratch, searching only the rest;
    the steps of a deeper run give a shallower plan with no search at all."""
    model = built_model()
    batches, selection = random_batches(n=2), selection_batches()
    cfg = PlanConfig(criterion="repair_greedy", num_layers=3)
    scratch = repair_greedy_plan(cfg, PLAIN, inputs(model, batches, selection))
    two = repair_greedy_plan(
        PlanConfig(criterion="repair_greedy", num_layers=2), PLAIN, inputs(model, batches, selection)
    )
    taken = [two.candidates["step 1"], two.candidates["step 2"]]
    resumed = repair_greedy_plan(cfg, PLAIN, inputs(model, batches, selection, taken=taken))
    assert resumed.removed == scratch.removed
    assert resumed.candidates["step 3"]["kept"] == scratch.candidates["step 3"]["kept"]
    for block, kl in scratch.candidates["step 3"]["tried"].items():
        assert resumed.candidates["step 3"]["tried"][block] == pytest.approx(kl, rel=1e-6, abs=1e-9)
    assert [resumed.candidates[f"step {t}"].get("reused", False) for t in (1, 2, 3)] == [True, True, False]
    assert resumed.costs["reused_steps"] == 2
    assert resumed.costs["selection_forwards"] == 3  # step 3 alone: 5 removable blocks less the 2 taken
    shallow = repair_greedy_plan(
        PlanConfig(criterion="repair_greedy", num_layers=2),
        PLAIN,
        inputs(model, batches, selection, taken=[scratch.candidates[f"step {t}"] for t in (1, 2, 3)]),
    )
    assert shallow.removed == two.removed
    assert shallow.costs["selection_forwards"] == 0 and shallow.costs["dense_passes"] == 0


def test_candidate_statistics_are_a_single_plan_calibrations():
    model = tiny_model("llama", num_layers=6)
    batches = random_batches(n=3)
    cfg = RecoveryConfig()
    fitter = RepairFitter(model, [cfg], batches)
    plans = [PruningPlan.from_layers(list(range(i, i + 2)), 6) for i in (1, 2, 3)]
    fitter.collect_dense([p.gaps[0] for p in plans])
    assert fitter.passes["dense"] == 1
    for plan in plans:
        gap = plan.gaps[0]
        alone = {gap.key: make_collectors({"ghost"}, 64, "cpu", [cfg])}
        accumulate(model, PrunedModel(model, plan).stack, plan.gaps, batches, alone)
        mine = fitter.dense[(gap.start, gap.stop)]["ghost"].state_dict()
        theirs = alone[gap.key]["ghost"].state_dict()
        assert mine.keys() == theirs.keys()
        for k, v in theirs.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(mine[k], v), (gap.key, k)


def test_a_cached_sequential_fit_equals_a_fresh_one():
    model = tiny_model("llama", num_layers=7)
    batches = random_batches(n=2)
    cfg = RecoveryConfig()  # ghost, order: sequential
    plan = PruningPlan.from_layers([2, 4], 7)
    fresh = RepairFitter(model, [cfg], batches)
    fresh.collect_dense(fresh.needed(plan))
    a = fresh.repaired(plan)
    cached = RepairFitter(model, [cfg], batches)
    cached.collect_dense(cached.needed(plan))
    cached.repaired(plan, cache=True).remove_hooks()
    passes = cached.passes["student"]
    b = cached.repaired(plan, cache=True)
    assert cached.passes["student"] == passes == 1  # the second gap's student pass is not repeated
    for key in ("2-2", "4-4"):
        mine, theirs = a.operators["ghost"][key].state_dict(), b.operators["ghost"][key].state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    a.remove_hooks()
    b.remove_hooks()


def test_the_scorer_gives_zero_kl_to_the_dense_model_itself_and_the_pruned_kl_of_evaluation():
    from ghostdistill.pipeline.evaluate import score_views

    model = tiny_model("llama", num_layers=6)
    sel = selection_batches()
    scorer = SelectionScorer(model, sel)
    pruned = PrunedModel(model, PruningPlan.from_layers([2, 3], 6))
    mine = scorer.score(pruned, [PRUNED])[PRUNED]
    kl, n = 0.0, 0
    for b in sel:
        scores = score_views(pruned, b["input_ids"], torch.ones_like(b["input_ids"]), [PRUNED])[PRUNED]
        kl += float(scores.kl.double().sum())
        n += scores.kl.numel()
    assert mine["kl"] == pytest.approx(kl / n, rel=1e-6)
    pruned.remove_hooks()
    assert math.isfinite(mine["top1"]) and 0 <= mine["top1"] <= 1


def test_candidate_models_leave_the_dense_model_as_it_was():
    model = built_model()
    ids = random_batches(n=1, seed=5)[0]["input_ids"]
    with torch.no_grad():
        before = model(input_ids=ids).logits
    cfg = PlanConfig(criterion="repair", num_layers=2, repair_method="ghost_paper")
    choose(cfg, model, random_batches(n=2), recovery=[PLAIN], selection=selection_batches())
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert len(model.model.layers) == 7 and torch.equal(before, after)


def test_plan_checks_and_bad_settings():
    assert check_plan(PlanConfig(criterion="repair", num_layers=3), 7) is None
    assert check_plan(PlanConfig(criterion="repair_greedy", num_layers=3), 7) is None
    with pytest.raises(ValueError, match="cannot remove 6 contiguous"):
        check_plan(PlanConfig(criterion="repair", num_layers=6), 7)
    with pytest.raises(ValueError, match="plan.repair_method is read only by"):
        PlanConfig(num_layers=2, repair_method="ghost").validate()
    with pytest.raises(ValueError, match="plan.repair_chunk must be >= 1"):
        PlanConfig(criterion="repair", num_layers=2, repair_chunk=0).validate()
    with pytest.raises(ValueError, match="'ghots' is neither a recovery entry"):
        repair_config(PlanConfig(criterion="repair", num_layers=2, repair_method="ghots"), [PLAIN])
    assert repair_config(PlanConfig(criterion="repair", num_layers=2), [PLAIN]) is PLAIN
    lp = repair_config(PlanConfig(criterion="repair", num_layers=2, repair_method="linearpatch"), [PLAIN])
    assert lp.method == "linearpatch" and lp.variant == "rotate"
    with pytest.raises(ValueError, match="data.selection"):
        get_criterion("repair").choose(
            PlanConfig(criterion="repair", num_layers=1), PlanInputs(None, None, [], recovery=[PLAIN])
        )


def test_chunked_candidates_choose_the_same_plan():
    model = built_model()
    batches = random_batches(n=2)
    whole = repair_plan(
        PlanConfig(criterion="repair", num_layers=2), PLAIN, inputs(model, batches, selection_batches())
    )
    chunked = repair_plan(
        PlanConfig(criterion="repair", num_layers=2, repair_chunk=2), PLAIN, inputs(model, batches, selection_batches())
    )
    assert chunked.removed == whole.removed and chunked.candidates == whole.candidates
    assert chunked.costs["dense_passes"] == 2 and whole.costs["dense_passes"] == 1


def test_plan_fingerprints_of_other_criteria_are_unchanged_by_the_repair_keys():
    from dataclasses import asdict

    cfg = PlanConfig(num_layers=7)
    later = ("repair_method", "repair_chunk", "greedy_from", "greedy_start", "criterion_options")
    old = {k: v for k, v in asdict(cfg).items() if k not in later}
    assert cfg.digest_dict() == old
    repair = PlanConfig(criterion="repair", num_layers=7, repair_method="ghost", repair_chunk=4)
    assert repair.digest_dict()["repair_method"] == "ghost" and "repair_chunk" not in repair.digest_dict()
    # Where a greedy search takes its first steps from changes its time, not its plan.
    greedy = PlanConfig(criterion="repair_greedy", num_layers=7, greedy_from="runs/repair_greedy_5")
    assert greedy.digest_dict() == PlanConfig(criterion="repair_greedy", num_layers=7).digest_dict()
    # Where a greedy search starts decides its plan.
    started = PlanConfig(criterion="repair_greedy", num_layers=7, greedy_start=[3, 4])
    assert started.digest_dict()["greedy_start"] == [3, 4]
    with pytest.raises(ValueError, match="plan.greedy_from names a repair_greedy run .* plan.criterion is 'repair'"):
        PlanConfig(criterion="repair", num_layers=7, greedy_from="runs/x").validate()


def test_starting_candidates_at_their_gap_scores_as_full_forwards():
    model = tiny_model("llama", num_layers=7)
    sel = selection_batches()
    plan = PruningPlan.from_layers([3, 4], 7)
    full = SelectionScorer(model, sel)
    short = SelectionScorer(model, sel, starts=[3])
    # ReplaceMe maps the MLP output of the block before the gap (block 2): its forward must start there.
    methods = [RecoveryConfig(), RecoveryConfig(name="replaceme", method="replaceme")]
    fitter = RepairFitter(model, methods, random_batches(n=2))
    fitter.collect_dense(plan.gaps)
    pruned = fitter.repaired(plan)
    views = [PRUNED, "ghost", "replaceme"]
    a = full.score(pruned, views)
    b = short.score(pruned, views, start=3)
    pruned.remove_hooks()
    assert short.skip and short._checked
    for view in views:
        assert b[view]["kl"] == pytest.approx(a[view]["kl"], rel=1e-4), view
        assert b[view]["top1"] == pytest.approx(a[view]["top1"], abs=1e-6), view
    assert abs(a["replaceme"]["kl"] - a[PRUNED]["kl"]) > 1e-3  # the map is scored, not skipped


def test_keeping_the_dense_log_probabilities_scores_as_recomputing_them(monkeypatch):
    from ghostdistill.planning import scoring

    model = tiny_model("llama", num_layers=7)
    sel = selection_batches()
    plan = PruningPlan.from_layers([3, 4], 7)
    kept = SelectionScorer(model, sel, starts=[3])
    monkeypatch.setattr(scoring, "DENSE_LOGP_BYTES", 0)
    recomputed = SelectionScorer(model, sel, starts=[3])
    assert kept.dense_logp is not None and recomputed.dense_logp is None
    fitter = RepairFitter(model, [RecoveryConfig()], random_batches(n=2))
    fitter.collect_dense(plan.gaps)
    pruned = fitter.repaired(plan)
    a = kept.score(pruned, [PRUNED, "ghost"], start=3)
    b = recomputed.score(pruned, [PRUNED, "ghost"], start=3)
    pruned.remove_hooks()
    assert a == b  # the same numbers, bit for bit


def test_criterion_samples_caps_the_windows_the_candidates_are_fitted_on():
    model = built_model()
    batches = random_batches(n=4)
    capped = PlanConfig(criterion="repair", num_layers=1, repair_method="ghost_paper", criterion_samples=8)
    a = choose(capped, model, batches, recovery=[PLAIN], selection=selection_batches())
    b = choose(
        PlanConfig(criterion="repair", num_layers=1, repair_method="ghost_paper"),
        model,
        batches[:2],
        recovery=[PLAIN],
        # 2 batches of 4 windows: the first 8 windows
        selection=selection_batches(),
    )
    assert a.candidates == b.candidates


def test_greedy_from_a_start_is_the_search_after_those_blocks():
    """`plan.greedy_start` removes its blocks first: started from the scratch search's first two blocks, the
    search takes the same third step (the same KLs); started elsewhere it keeps the start and adds to it."""
    model = built_model()
    batches, selection = random_batches(n=2), selection_batches()
    scratch = repair_greedy_plan(
        PlanConfig(criterion="repair_greedy", num_layers=3), PLAIN, inputs(model, batches, selection)
    )
    first_two = [scratch.candidates[f"step {t}"]["kept"] for t in (1, 2)]
    cfg = PlanConfig(criterion="repair_greedy", num_layers=3, greedy_start=first_two)
    cfg.validate()
    started = repair_greedy_plan(cfg, PLAIN, inputs(model, batches, selection))
    assert started.removed == scratch.removed
    assert list(started.candidates) == ["step 3"] and started.costs["start"] == sorted(first_two)
    for block, kl in scratch.candidates["step 3"]["tried"].items():
        assert started.candidates["step 3"]["tried"][block] == pytest.approx(kl, rel=1e-6, abs=1e-9)
    assert started.costs["selection_forwards"] == 3
    other = repair_greedy_plan(
        PlanConfig(criterion="repair_greedy", num_layers=3, greedy_start=[4, 5]),
        PLAIN,
        inputs(model, batches, selection),
    )
    assert {4, 5} < set(other.removed) and list(other.scores) == [str(other.candidates["step 3"]["kept"])]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"criterion": "repair", "greedy_start": [3]}, "set plan.criterion repair_greedy"),
        ({"greedy_start": [3, 4, 5]}, "name fewer blocks than num_layers"),
        ({"greedy_start": [3, 3]}, "distinct 0-based block indices"),
        ({"greedy_start": [-1]}, "distinct 0-based block indices"),
        ({"greedy_start": [3], "greedy_from": "runs/x"}, "keep one of them"),
    ],
)
def test_a_bad_greedy_start_is_refused_before_any_work(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanConfig(**{"criterion": "repair_greedy", "num_layers": 3, **kwargs}).validate()


def test_a_greedy_start_block_that_is_not_removable_is_named():
    model = built_model()
    cfg = PlanConfig(criterion="repair_greedy", num_layers=3, greedy_start=[0])  # keep_first 1 protects block 0
    with pytest.raises(ValueError, match=r"blocks \[0\] are not removable"):
        repair_greedy_plan(cfg, PLAIN, inputs(model, random_batches(n=1), selection_batches()))
