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
    [([0, 1], "first or last"), ([14, 15], "first or last"), ([3, 3], "twice"), ([16], "out of range"),
     ([-1], "out of range"), ([], "empty")],
)
def test_invalid_plans_name_the_problem(layers, match):
    with pytest.raises(ValueError, match=match):
        PruningPlan.from_layers(layers, 16)


def test_edges_allowed_when_insisted():
    plan = PruningPlan.from_layers([0, 15], 16, allow_edges=True)
    assert plan.gaps == [Gap(0, 1), Gap(15, 16)]
    with pytest.raises(ValueError, match="at least one"):
        PruningPlan.from_layers(list(range(16)), 16, allow_edges=True)
