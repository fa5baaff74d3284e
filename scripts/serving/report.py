"""What the serving checks (`scripts/check_serving.py`, `scripts/serving/check_llama_cpp.py`) compare and print:
where a served continuation parts from transformers' (and transformers' logit margin there), and their markdown
tables, the cross-stack one and llama.cpp's."""

from __future__ import annotations

import torch


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two continuations share before they part."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@torch.no_grad()
def divergence_margins(pruned, view: str, prompts: list, expected: list, got: list) -> list:
    """Where a continuation parts from transformers': per prompt None (identical) or {"at": position,
    "margin": transformers' logit of its own token minus its logit of llama.cpp's token there}. A margin far
    below the logits' own spread is a near-tie that rounding decides, not a different model."""
    out: list = []
    for prompt, a, b in zip(prompts, expected, got):
        at = common_prefix(a, b)
        if at == min(len(a), len(b)):
            out.append(None)
            continue
        with pruned.use(view) as model:
            logits = model(input_ids=torch.tensor([prompt + a[:at]])).logits[0, -1].float()
        out.append({"at": at, "margin": float(logits[a[at]] - logits[b[at]])})
    return out


def columns(stacks: list[str], gguf_types) -> list[str]:
    """The stacks' columns: llama.cpp has one per GGUF type."""
    out: list[str] = []
    for stack in stacks:
        if stack == "llama.cpp":
            out += [f"llama.cpp {t}" for t in gguf_types]
        elif stack != "transformers":
            out.append(stack)
    return out


def parted(tokens: list[list[int]], reference: list[list[int]]) -> list[int | None]:
    """Per prompt, the first position where `tokens` part from `reference` (None: identical)."""
    return [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), None) for t, r in zip(tokens, reference)]


def quantized_cell(s: dict) -> str:
    """A quantized folder in vLLM: greedy tokens identical to the float view's in vLLM (how many prompts; the
    first parting position of the others) and the perplexity with its difference from the float view's."""
    same = sum(p is None for p in s["parted"])
    where = ",".join(f"@{p}" for p in s["parted"] if p is not None)
    tokens = "✔" if same == len(s["parted"]) else f"✗ {same}/{len(s['parted'])} ({where})"
    return f"{tokens} {s['ppl']:.2f} ({100 * s['rel_diff']:+.2f}%)"


def stacks_table(report: dict, stacks: list[str], gguf_types) -> str:
    """One row per view, one column per stack: ✔/✗ (greedy tokens identical to transformers') and the
    perplexity measured there, with its difference from transformers' on the same tokens (llama.cpp: the
    second half of each window, beside transformers' figure over those tokens)."""
    schemes = report.get("schemes") or []
    head = ["view", "kind", "transformers"] + columns(stacks, gguf_types) + [f"vllm {s}" for s in schemes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for view, r in report["views"].items():
        t = r["transformers"]
        cells = [
            view,
            r["kind"],
            f"{'✔' if t['same_tokens_as_run'] else '✗'} {t['ppl']:.2f} (run {r['ppl_run']:.2f})",
        ]
        for stack in head[3:]:
            s = r.get(stack)
            if s is None:
                cells.append("–")
            elif "error" in s:
                cells.append(f"not served: {s['error']}")
            elif "parted" in s:
                cells.append(quantized_cell(s))
            elif "refused" in s:
                cells.append("refused: operators" if stack.startswith("llama.cpp") else f"refused: {s['refused']}")
            elif "reference" in s:
                cells.append(
                    f"{'✔' if s['same_tokens'] else '✗'} {s['ppl']:.2f} ({100 * s['rel_diff']:+.3f}% vs "
                    f"{s['reference']:.2f})"
                )
            else:
                cells.append(f"{'✔' if s['same_tokens'] else '✗'} {s['ppl']:.2f} ({100 * s['rel_diff']:+.3f}%)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _margins(entry: dict) -> str:
    """Where each diverging continuation parts, and transformers' logit margin there: ``@17 Δ0.004``."""
    return ", ".join(f"@{d['at']} Δ{d['margin']:.3f}" for d in entry.get("divergence", []) if d)


def llama_cpp_table(report: dict, gguf_types) -> str:
    """One row per view: transformers' perplexity on the second half of each window and the run's own, then per
    GGUF type ✔/✗ (greedy tokens identical to transformers'; where the others part) and llama-perplexity's
    figure with its difference from transformers'."""
    types = [t for t in gguf_types if any(t in r for r in report["views"].values())]
    head = ["view", "transformers (2nd half)", "run (all tokens)"] + [f"llama.cpp {t}" for t in types]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for view, r in report["views"].items():
        if "refused" in r:
            lines.append(f"| {view} | " + " | ".join(["–", "–"] + ["refused: operators"] * len(types)) + " |")
            continue
        cells = [view, f"{r['transformers']['ppl_second_half']:.3f}", f"{r['ppl_run']:.3f}"]
        for t in types:
            s = r[t]
            mark = "✔" if s["same_tokens"] else f"✗ ({s['same_prompts']}/{len(s['tokens'])}: {_margins(s)})"
            cells.append(f"{mark} {s['ppl']:.3f} ({100 * s['rel_diff']:+.2f}%)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
