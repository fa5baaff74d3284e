"""Extending ghostdistill from code of your own, one registration per idea (docs/development.md, "How to
add ..."): a recovery method with a config key of its own, a plan criterion, a student part and an export
format, each written here, outside the package, and registered in one place (`toys`). A tiny `fit` runs with
all four (the criterion chooses the plan, the method is fitted and fine-tuned with the part, the views are
written in the format), and `export <run>` writes the method's view through the format again without a
Trainer. The method's key is checked like any key, shows in `--print_config` and makes a saved result stale
when it changes. A name that is taken is refused, naming both registrants."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_run_args

import ghostdistill.distill as distill
import ghostdistill.export.formats as formats
import ghostdistill.methods as methods
import ghostdistill.planning as planning
from ghostdistill.cli import main
from ghostdistill.core.operator import GhostOperator
from ghostdistill.core.plan import Gap, PruningPlan

# ----------------------------------------------------------------------------- a recovery method and its key


class MeanScale:
    """Σ x_pre·x_post and Σ x_pre·x_pre over the real tokens: the best single scale in x_post ≈ s·x_pre."""

    def __init__(self, hidden_size: int, device) -> None:
        self.cross = torch.zeros((), dtype=torch.float64, device=device)
        self.square = torch.zeros((), dtype=torch.float64, device=device)

    def update(self, taps: methods.GapTaps) -> None:
        keep = taps.mask.bool()
        x, y = taps.x_pre[keep].double(), taps.x_post[keep].double()
        self.cross += (x * y).sum()
        self.square += (x * x).sum()

    def state_dict(self) -> dict:
        return {"cross": self.cross, "square": self.square}

    def load_state_dict(self, state: dict) -> None:
        self.cross, self.square = state["cross"], state["square"]


@dataclass
class ToyScaleConfig(methods.Ordered):
    """Args:
    damping: how much of the fitted scale's change from 1 is applied (0: none, 1: all of it).
    """

    damping: float = 1.0

    def validate(self) -> None:
        if not 0 <= self.damping <= 1:
            raise ValueError(f"damping must be in [0, 1], got {self.damping}")


class ToyScale(methods.Method):
    name = "toy_scale"
    config = ToyScaleConfig
    card = "toy scale: one damped scalar per gap"

    def collector(self, hidden_size, device):
        return MeanScale(hidden_size, device)

    def fit(self, cfg: ToyScaleConfig, gap: Gap, stats: MeanScale, hidden_size: int) -> methods.GapFit:
        s = 1 + cfg.damping * (float(stats.cross / stats.square) - 1)
        op = GhostOperator(hidden_size)
        op.load_solution((s - 1) * torch.eye(hidden_size, dtype=torch.float64))
        return methods.GapFit(operator=op)


# ----------------------------------------------------------------------------- a plan criterion


class DeepestFirst(planning.Criterion):
    """Removes the deepest removable blocks (as if depth alone told what a block is worth)."""

    name = "deepest_first"

    def choose(self, cfg: planning.PlanConfig, inputs: planning.PlanInputs) -> PruningPlan:
        keep_first, keep_last = planning.protected_edges(cfg)
        blocks = planning.candidate_blocks(len(inputs.stack.layers), cfg.num_layers, keep_first, keep_last)
        chosen = blocks[-cfg.num_layers :]
        return PruningPlan.from_layers(chosen, len(inputs.stack.layers), chosen_by=self.name)


# ----------------------------------------------------------------------------- a student part


class FinalNorm(distill.Part):
    """A copy of the final norm of the student's own, trained at `norm_lr`."""

    name = "final_norm"
    lr_key = "norm_lr"
    fsdp = "refuse"

    def build(self, students, views: list[str]) -> None:
        model = students.pruned.model
        path = next(n for n, m in model.named_modules() if m is model.model.norm)
        for view in views:
            distill.parts.own_modules(students, view, {path: model.model.norm})

    def params(self, students, view: str, student) -> dict[str, torch.nn.Parameter]:
        own = students.pruned.modules_own[view] if view in students.pruned.modules_own else {}
        return {f"final_norm.{view}.{name}": p for key, m in own.items() for name, p in m.named_parameters()}


# ----------------------------------------------------------------------------- an export format


class TorchFile(formats.ExportFormat):
    """The view's tensors in one torch file, `<dir>/<view>.pt`, with its kind."""

    name = "torch_file"

    def targets(self, root: Path, view: str, options) -> list[Path]:
        return [Path(root) / f"{view}.pt"]

    def write(self, view, root: Path, options) -> list[Path]:
        (path,) = self.targets(root, view.view, options)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"kind": view.kind, "state": {k: v.detach().cpu() for k, v in view.state.items()}}, path)
        return [path]


@pytest.fixture(scope="module")
def toys():
    """The one place each idea is registered (and unregistered after)."""
    registered = [
        (methods, methods.register(ToyScale())),
        (planning, planning.register(DeepestFirst())),
        (distill, distill.register(FinalNorm())),
        (formats, formats.register(TorchFile())),
    ]
    yield
    for registry, item in registered:
        registry.unregister(item.name)


def _args(tiny_dir, text_files, run: Path, damping: float, *extra: str) -> list[str]:
    student = {"name": "toy_ft", "method": "toy", "train": ["operators", "final_norm"]}
    return tiny_run_args(
        tiny_dir,
        text_files,
        run,
        "--model.plan.criterion",
        "deepest_first",
        "--model.distill.students",
        json.dumps([student]),
        "--trainer.max_steps",
        "2",
        "--model.evaluation.analysis",
        "false",
        *extra,
        layers=None,
        num_layers=2,
        recovery=[{"name": "toy", "method": "toy_scale", "damping": damping}],
        samples=8,
    )


def test_a_method_a_criterion_a_part_and_a_format_of_ones_own_run_and_export(toys, tiny_dir, text_files, tmp_path):
    run = tmp_path / "run"
    export = ["--export.views", "[toy, toy_ft]", "--export.format", "[hf, torch_file]"]
    main(_args(tiny_dir, text_files, run, 0.5, *export))
    results = json.loads((run / "results.json").read_text())
    # The criterion chose the plan: the deepest removable blocks (keep_last protects block 5).
    assert results["plan"]["chosen_by"] == "deepest_first" and results["plan"]["removed"] == [3, 4]
    # The method was fitted with its own key, and the part trained the student's own final norm.
    assert results["recovery"]["toy"] | {"fit_s": 0} == {
        "name": "toy", "method": "toy_scale", "order": "sequential", "damping": 0.5, "fit_s": 0
    }  # fmt: skip
    assert results["distill"]["resolved"]["toy_ft"]["train"] == ["operators", "final_norm"]
    trained = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["ghostdistill"]["students"]["toy_ft"]
    norm = [v for k, v in trained.items() if k.startswith("final_norm.toy_ft.")]
    assert norm and not torch.equal(norm[0], torch.ones_like(norm[0])), "the student's own final norm trained"
    # The views were written in the format (beside the Hugging Face folders), as the view it prepared.
    saved = torch.load(run / "export" / "toy.pt", weights_only=True)
    assert saved["kind"] == "operators" and any(k.startswith("gap_operators.") for k in saved["state"])
    assert (run / "export" / "toy_ft.pt").is_file() and (run / "export" / "toy" / "config.json").is_file()
    # `export <run>` writes the method's view through the format again, without a Trainer: the same tensors.
    out = tmp_path / "again"
    (path,) = main(["export", str(run), "--views", "toy", "--dir", str(out), "--format", "torch_file"])
    again = torch.load(path, weights_only=True)
    assert again["state"].keys() == saved["state"].keys()
    assert all(torch.equal(again["state"][k], saved["state"][k]) for k in saved["state"])


def test_the_methods_own_key_is_checked_printed_and_part_of_the_settings(toys, tiny_dir, text_files, tmp_path, capsys):
    from ghostdistill.pipeline.settings import stale
    from ghostdistill.runner.config import parse_fit

    args = _args(tiny_dir, text_files, tmp_path / "run", 0.5)[1:]
    with pytest.raises(SystemExit):
        main(["fit", *args, "--print_config"])
    printed = capsys.readouterr().out
    assert "method: toy_scale" in printed and "damping: 0.5" in printed
    with pytest.raises(ValueError, match=r"recovery\[0\] 'toy' \(toy_scale\): damping must be in \[0, 1\], got 2.0"):
        main(["fit", *_args(tiny_dir, text_files, tmp_path / "run", 2.0)[1:]])
    with pytest.raises(ValueError, match="damping"):
        main(["fit", *args, "--model.recovery", json.dumps([{"name": "t", "method": "toy_scale", "damping": "x"}])])
    saved = parse_fit(args, "test").settings()
    assert stale(saved, parse_fit(args, "test").settings()) is None
    assert stale(saved, parse_fit(_args(tiny_dir, text_files, tmp_path / "run", 0.25)[1:], "test").settings()) == (
        "other model.recovery"
    )
    # A key no entry sets changes no saved result of the shipped methods.
    ghost = [*args, "--model.recovery", json.dumps([{"name": "ghost"}])]
    with_toys = parse_fit(ghost, "test").settings()
    assert "damping" not in json.dumps(with_toys["model"]["recovery"])


def test_a_taken_name_is_refused_naming_both_registrants(toys):
    class Impostor(ToyScale):
        name = "ghost"

    cases = [
        (methods.register, Impostor(), r"recovery method 'ghost' is registered by ghostdistill.methods.ghost.Ghost; "),
        (planning.register, type("Streamline", (DeepestFirst,), {"name": "streamline"})(), r"criterion 'streamline' is registered by ghostdistill.planning.similarity.RunSimilarity; "),
        (distill.register, type("Lora", (FinalNorm,), {"name": "lora"})(), r"student part 'lora' is registered by ghostdistill.distill.parts.Lora; "),
        (formats.register, type("Hf", (TorchFile,), {"name": "hf"})(), r"export format 'hf' is registered by ghostdistill.export.formats.HuggingFace; "),
        (methods.register, ToyScale(), r"recovery method 'toy_scale' is registered by test_extending.ToyScale; test_extending.ToyScale"),
    ]  # fmt: skip
    for register, item, match in cases:
        with pytest.raises(ValueError, match=match + r".*cannot take the name"):
            register(item)
