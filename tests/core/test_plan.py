import pytest

from ghostdistill.core.plan import Gap, PruningPlan


def test_gaps_and_kept():
    plan = PruningPlan.from_layers([9, 3, 4, 10, 11], 16)
    assert plan.removed == (3, 4, 9, 10, 11)
    assert plan.gaps == [Gap(3, 5), Gap(9, 12)]
    assert [g.key for g in plan.gaps] == ["3-4", "9-11"]
    assert plan.kept == (0, 1, 2, 5, 6, 7, 8, 12, 13, 14, 15)
    assert plan.to_dict()["gaps"] == ["3-4", "9-11"]


@pytest.mark.parametrize(
    "layers, match",
    [
        ([0, 1], "first or last"),
        ([14, 15], "first or last"),
        ([3, 3], "twice"),
        ([16], "out of range"),
        ([-1], "out of range"),
        ([], "empty"),
    ],
)
def test_invalid_plans_name_the_problem(layers, match):
    with pytest.raises(ValueError, match=match):
        PruningPlan.from_layers(layers, 16)


def test_edges_allowed_when_insisted():
    plan = PruningPlan.from_layers([0, 15], 16, allow_edges=True)
    assert plan.gaps == [Gap(0, 1), Gap(15, 16)]
    with pytest.raises(ValueError, match="at least one"):
        PruningPlan.from_layers(list(range(16)), 16, allow_edges=True)


@pytest.mark.parametrize(
    "cfg, match",
    [
        (
            {"layers": [2, 3], "num_layers": 7},
            r"plan.layers \[2, 3\] and plan.num_layers 7 are both set.*num_layers null",
        ),
        ({"layers": None, "num_layers": None}, "either layers"),
        ({"layers": [], "num_layers": None}, "empty"),
        ({"layers": [4, -2], "num_layers": None}, r"\[-2\] out of range: layers are 0-based"),
        ({"layers": [3, 5, 3], "num_layers": None}, r"lists layer\(s\) \[3\] twice"),
        ({"num_layers": 0}, "num_layers must be >= 1.*got 0"),
        ({"num_layers": 2, "keep_first": -1}, "keep_first and plan.keep_last must be >= 0, got -1"),
        ({"num_layers": 2, "criterion_samples": 0}, "criterion_samples must be >= 1.*got 0"),
    ],
)
def test_plan_values_are_checked_without_a_model(cfg, match):
    from ghostdistill.planning import PlanConfig

    with pytest.raises(ValueError, match=match):
        PlanConfig(**cfg).validate()


def test_bad_plan_fails_before_the_model_or_tokenizer_is_loaded():
    """The module checks its plan first: a nonexistent model source is never reached."""
    from ghostdistill.core.model import ModelConfig
    from ghostdistill.lit.module import GhostDistill
    from ghostdistill.planning import PlanConfig

    with pytest.raises(ValueError, match="twice"):
        GhostDistill(model=ModelConfig(source="/nonexistent/model"), plan=PlanConfig(layers=[2, 2]))


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"layers": [3, 6]}, r"\[6\] out of range: the model has layers 0..5"),
        ({"layers": [0, 1]}, "first or last layer.*allow_edges"),
        ({"layers": [5]}, "first or last layer"),
        ({"layers": list(range(6)), "allow_edges": True}, "removes all 6 layers"),
        (
            {"num_layers": 5},
            (
                r"num_layers 5 with plan.criterion 'streamline': cannot remove 5 contiguous layers "
                r"from 6 \(keeping the first 1 and last 1; at most 4 can go\)"
            ),
        ),
        ({"num_layers": 4, "criterion": "taylor", "keep_first": 2, "keep_last": 1}, "3 are removable"),
        ({"num_layers": 6, "criterion": "block_influence", "allow_edges": True}, "at most 5 can go"),
    ],
)
def test_depth_checks_name_the_value_and_the_valid_range(cfg, match):
    from ghostdistill.planning import PlanConfig, check_plan

    with pytest.raises(ValueError, match=match):
        check_plan(PlanConfig(**cfg), 6)


def test_check_plan_returns_the_explicit_plan_or_none():
    from ghostdistill.planning import PlanConfig, check_plan

    assert check_plan(PlanConfig(layers=[2, 3]), 6).removed == (2, 3)
    assert check_plan(PlanConfig(num_layers=4), 6) is None
