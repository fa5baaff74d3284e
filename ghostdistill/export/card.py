"""The model card (README.md) of an exported folder: what was removed, how it was repaired, what was
measured, with the numbers of the run that produced it (from the `ghostdistill` record in config.json)."""

from __future__ import annotations

from ..methods import get_method, registered

LOADING = {
    "operators": """The operators are modules of their own (`modeling_ghostdistill.py`, in this folder):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("<this folder>", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("<this folder>")
```

With ghostdistill installed, `ghostdistill.export.load_exported(folder)` loads it without remote code.""",
    "plain": """A plain checkpoint of the base architecture with fewer blocks:

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("<this folder>")
```""",
}


def model_card(info: dict, kind: str) -> str:
    """Markdown for the folder's README.md; `kind` is ``operators`` (custom code) or ``plain`` (`LOADING`)."""
    plan = info.get("plan", {})
    removed = plan.get("removed", [])
    total = plan.get("num_layers")
    view, method = info.get("view"), info.get("method")
    base = info.get("base_model", "the base model")
    if method is None or method in ("dense", "pruned"):
        repair = "no repair (the pruned model)"
    else:  # as the method says (`Method.card`)
        repair = (get_method(method).card if method in registered() else "") or f"method `{method}`"
    lines = [
        "---",
        "library_name: transformers",
        "tags: [ghostdistill, layer-pruning]",
        "---",
        "",
        f"# {view}: {base} with {len(removed)} of {total} blocks removed",
        "",
        f"- **Removed blocks** (0-based, of the original {total}): {removed}"
        + (f", chosen by `{plan['chosen_by']}`" if plan.get("chosen_by") else ""),
        f"- **Repair**: {repair}",
    ]
    distill = info.get("distill")
    if distill:
        lines.append(
            f"- **Fine-tuned**: distilled against the dense model for {distill.get('steps')} steps "
            f"({', '.join(distill.get('train', []))}); these weights are the {distill.get('kept')} step"
            + (f" (step {distill['step']})" if distill.get("step") is not None else "")
        )
    cal = info.get("calibration")
    if cal:
        source = cal.get("source")
        if isinstance(source, dict):
            first = source.get("first_document") or 0
            count = source.get("max_documents")
            docs = (
                f", documents {first}–{first + count - 1}" if count else (f", documents from {first}" if first else "")
            )
            source = f"{source.get('source')}{docs}"
        lines.append(
            f"- **Calibration**: {cal.get('windows', cal.get('num_samples'))} windows of {cal.get('seq_len')} tokens "
            f"from {source} ({cal.get('tokens')} tokens), seed {cal.get('seed')}"
        )
    if info.get("seed") is not None:
        lines.append(f"- **Seed**: {info['seed']}")
    if info.get("warnings"):  # what the export printed: a flagged view, a file a reader would misread
        lines += ["", "## Warnings", "", *(f"- {w}" for w in info["warnings"])]
    metrics = info.get("metrics") or {}
    if metrics:
        lines += [
            "",
            "## Measured in the run that produced these weights",
            "",
            "| evaluation | perplexity | KL(dense ‖ this) | top-1 agreement with dense | tokens |",
            "|---|---|---|---|---|",
        ]
        for source, m in metrics.items():
            kl, top1 = (f"{m[k]:.4f}" if k in m else "–" for k in ("kl", "top1"))
            lines.append(f"| {source} | {m['ppl']:.4f} | {kl} | {top1} | {m.get('tokens', '–')} |")
        reference = info.get("reference_metrics") or {}
        for name, per_source in reference.items():
            cells = ", ".join(f"{s} {m['ppl']:.2f}" for s, m in per_source.items())
            lines.append(f"\n{name} perplexity in the same run: {cells}")
        ev = info.get("evaluation") or {}
        if ev.get("sources"):
            described = "; ".join(
                f"{name}: {s.get('windows')} windows of {s.get('source')}" for name, s in ev["sources"].items()
            )
            lines.append(f"\nEvaluation: windows of {ev.get('seq_len')} tokens; {described}.")
    lines += ["", "## Loading", "", *LOADING[kind].splitlines()]
    lines += ["", "`config.json` records the plan and the run under the key `ghostdistill`.", ""]
    return "\n".join(lines)
