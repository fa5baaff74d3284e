"""Extending ghostdistill from code of your own, one registration per idea (docs/development.md, "How to
add ..."): a recovery method, a plan criterion, a student part and an export format, each written here,
outside the package, each with an option of its own (a dataclass of its keys: the method's `config`, the
others' `options`, `core.options`), and registered in one place (`toys`). A tiny `fit` runs with all four
(the criterion chooses the plan, the method is fitted and fine-tuned with the part, the views are written in
the format), each option set on the command line and changing what it does, and `export <run>` writes the
method's view through the format again without a Trainer. The same options from a YAML config file arrive
typed; a bad one is one line naming the plug-in, the key and what is valid. The method's key shows in
`--print_config` and makes a saved result stale when it changes. A name that is taken is refused, naming both
registrants."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

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


@dataclass
class DeepestOptions:
    """Args:
    skip: how many of the deepest removable blocks to pass over before removing.
    """

    skip: int = 0


class DeepestFirst(planning.Criterion):
    """Removes the deepest removable blocks (as if depth alone told what a block is worth)."""

    name = "deepest_first"
    options = DeepestOptions

    def choose(self, cfg: planning.PlanConfig, inputs: planning.PlanInputs) -> PruningPlan:
        keep_first, keep_last = planning.protected_edges(cfg)
        blocks = planning.candidate_blocks(len(inputs.stack.layers), cfg.num_layers, keep_first, keep_last)
        skip = self.options_of(cfg).skip
        chosen = blocks[len(blocks) - skip - cfg.num_layers : len(blocks) - skip]
        return PruningPlan.from_layers(chosen, len(inputs.stack.layers), chosen_by=self.name)


# ----------------------------------------------------------------------------- a student part


@dataclass
class FinalNormOptions:
    """Args:
    start: the copy's gain starts as `start` times the model's.
    """

    start: float = 1.0


class FinalNorm(distill.Part):
    """A copy of the final norm of the student's own, trained at `norm_lr`."""

    name = "final_norm"
    lr_key = "norm_lr"
    fsdp = "refuse"
    options = FinalNormOptions

    def build(self, students, views: list[str]) -> None:
        model = students.pruned.model
        path = next(n for n, m in model.named_modules() if m is model.model.norm)
        for view in views:
            distill.parts.own_modules(students, view, {path: model.model.norm})
            start = self.options_of(students.specs[view]).start
            with torch.no_grad():
                for module in students.pruned.modules_own[view].values():
                    module.weight.mul_(start)

    def params(self, students, view: str, student) -> dict[str, torch.nn.Parameter]:
        own = students.pruned.modules_own[view] if view in students.pruned.modules_own else {}
        return {f"final_norm.{view}.{name}": p for key, m in own.items() for name, p in m.named_parameters()}


# ----------------------------------------------------------------------------- an export format


@dataclass
class TorchFileOptions:
    """Args:
    dtype: the tensors' type in the file.
    """

    dtype: Literal["float32", "float16"] = "float32"


class TorchFile(formats.ExportFormat):
    """The view's tensors in one torch file, `<dir>/<view>.pt`, with its kind."""

    name = "torch_file"
    target = "file"
    options = TorchFileOptions

    def targets(self, root: Path, view: str, options) -> list[Path]:
        return [Path(root) / f"{view}.pt"]

    def write(self, view, root: Path, options) -> list[Path]:
        (path,) = self.targets(root, view.view, options)
        path.parent.mkdir(parents=True, exist_ok=True)
        dtype = getattr(torch, self.options_of(options).dtype)
        state = {k: v.detach().cpu().to(dtype) if v.is_floating_point() else v for k, v in view.state.items()}
        torch.save({"kind": view.kind, "state": state}, path)
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


def _args(tiny_dir, text_files, run: Path, damping: float, *extra: str, start: float = 1.0) -> list[str]:
    student = {"name": "toy_ft", "method": "toy", "train": ["operators", "final_norm"]}
    if start != 1.0:
        student["part_options"] = {"final_norm": {"start": start}}
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
    options = [
        "--model.plan.criterion_options",
        "{skip: 1}",
        "--export.format_options",
        "{torch_file: {dtype: float16}}",
    ]
    main(_args(tiny_dir, text_files, run, 0.5, *export, *options, start=0.5))
    results = json.loads((run / "results.json").read_text())
    # The criterion chose the plan with its option: the deepest removable blocks but one (keep_last protects
    # block 5, `skip: 1` passes over block 4).
    assert results["plan"]["chosen_by"] == "deepest_first" and results["plan"]["removed"] == [2, 3]
    # The method was fitted with its own key, and the part trained the student's own final norm.
    assert results["recovery"]["toy"] | {"fit_s": 0} == {
        "name": "toy", "method": "toy_scale", "order": "sequential", "damping": 0.5, "fit_s": 0
    }  # fmt: skip
    assert results["distill"]["resolved"]["toy_ft"]["train"] == ["operators", "final_norm"]
    trained = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["ghostdistill"]["students"]["toy_ft"]
    norm = [v for k, v in trained.items() if k.startswith("final_norm.toy_ft.")]
    assert norm and not torch.equal(norm[0], torch.full_like(norm[0], 0.5)), "the student's own final norm trained"
    # ... from its option's start (half the model's unit gains; two steps at norm_lr 1e-4 move it little).
    assert torch.allclose(norm[0], torch.full_like(norm[0], 0.5), atol=0.01), norm[0]
    assert results["distill"]["resolved"]["toy_ft"]["part_options"] == {"final_norm": {"start": 0.5}}
    # The views were written in the format (beside the Hugging Face folders), as the view it prepared, in the
    # format option's dtype.
    saved = torch.load(run / "export" / "toy.pt", weights_only=True)
    assert saved["kind"] == "operators" and any(k.startswith("gap_operators.") for k in saved["state"])
    assert {v.dtype for v in saved["state"].values() if v.is_floating_point()} == {torch.float16}
    assert (run / "export" / "toy_ft.pt").is_file() and (run / "export" / "toy" / "config.json").is_file()
    # `export <run>` writes the method's view through the format again, without a Trainer: the same tensors.
    out = tmp_path / "again"
    command = ["export", str(run), "--views", "toy", "--dir", str(out), "--format", "torch_file"]
    (path,) = main([*command, "--format-options", "{torch_file: {dtype: float16}}"])
    again = torch.load(path, weights_only=True)
    assert again["state"].keys() == saved["state"].keys()
    assert all(torch.equal(again["state"][k], saved["state"][k]) for k in saved["state"])
    # Without the option the format's default dtype; a bad value is named with the valid ones, before any work.
    (path,) = main([*command, "--overwrite"])
    assert torch.load(path, weights_only=True)["state"][next(iter(saved["state"]))].dtype == torch.float32
    with pytest.raises(
        ValueError,
        match=r"export.format_options.torch_file: dtype 'int8' is not known; choose one of \('float32', 'float16'\)",
    ):
        main([*command, "--overwrite", "--format-options", "{torch_file: {dtype: int8}}"])


def test_the_plug_ins_options_from_a_config_file_arrive_typed_and_bad_ones_are_named(
    toys, tiny_dir, text_files, tmp_path
):
    """The same keys from YAML (a config file as users write them) as from the command line above: each plug-in
    reads its options as its own class; a key it does not declare, a value outside its type or an option of a
    plug-in the run does not use is one line naming it, before anything loads."""
    from ghostdistill.runner.config import parse_fit

    config = tmp_path / "plugins.yaml"
    config.write_text(
        "model:\n"
        "  plan: {criterion_options: {skip: 2}}\n"
        "  distill:\n"
        "    students:\n"
        "      - {name: toy_ft, method: toy, train: [operators, final_norm], part_options: {final_norm: {start: 0.25}}}\n"
        "export:\n"
        "  format: [torch_file]\n"
        "  format_options: {torch_file: {dtype: float16}}\n"
    )
    args = _args(tiny_dir, text_files, tmp_path / "run", 0.5)[1:]
    parsed = parse_fit([*args, "--config", str(config)], "test")
    assert planning.get_criterion("deepest_first").options_of(parsed.cfg.plan) == DeepestOptions(skip=2)
    (student,) = parsed.cfg.distill.specs()
    assert distill.get_part("final_norm").options_of(student) == FinalNormOptions(start=0.25)
    assert parsed.rest["export"]["format_options"] == {"torch_file": {"dtype": "float16"}}
    bad = {
        "model:\n  plan: {criterion_options: {skp: 2}}\n": (
            r"plan.criterion_options \(deepest_first\): key 'skp' is not one of its options; its keys are: skip"
        ),
        "model:\n  plan: {criterion_options: {skip: two}}\n": (
            r"plan.criterion_options \(deepest_first\): skip must be a number, got 'two'"
        ),
        "model:\n  distill:\n    students:\n      - {name: toy_ft, method: toy, train: [operators, final_norm], part_options: {final_norm: {start: x}}}\n": (
            r"student toy_ft: part_options.final_norm: start must be a number, got 'x'"
        ),
        "model:\n  distill:\n    students:\n      - {name: toy_ft, method: toy, train: [operators], part_options: {final_norm: {start: 2}}}\n": (
            r"part_options names 'final_norm', which it does not train \(train: \['operators'\]\)"
        ),
        "export:\n  views: [toy]\n  format: [torch_file]\n  format_options: {torch_file: {dtype: int8}}\n": (
            r"export.format_options.torch_file: dtype 'int8' is not known"
        ),
        "export:\n  views: [toy]\n  format: [hf]\n  format_options: {torch_file: {dtype: float16}}\n": (
            r"export.format_options names \['torch_file'\], which are not among the formats \['hf'\]"
        ),
    }  # fmt: skip
    for text, match in bad.items():
        config.write_text(text)
        with pytest.raises(ValueError, match=match):
            main(["fit", *args, "--config", str(config), "--trainer.default_root_dir", str(tmp_path / "never")])
        assert not (tmp_path / "never").exists(), text  # refused before the run folder is made


def test_the_methods_own_key_is_checked_printed_and_part_of_the_settings(toys, tiny_dir, text_files, tmp_path, capsys):
    from ghostdistill.pipeline.settings import stale
    from ghostdistill.runner.config import parse_fit

    args = _args(tiny_dir, text_files, tmp_path / "run", 0.5)[1:]
    with pytest.raises(SystemExit):
        main(["fit", *args, "--print_config"])
    printed = capsys.readouterr().out
    assert "method: toy_scale" in printed and "damping: 0.5" in printed
    with pytest.raises(
        ValueError, match=r"model.recovery: entry 'toy' \(toy_scale\): damping must be in \[0, 1\], got 2.0"
    ):
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
