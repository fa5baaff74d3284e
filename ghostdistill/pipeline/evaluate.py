"""Evaluate: perplexity and teacher fidelity of every view, the analyses, zero-shot.

scores = score_views(pruned, ids, mask, views)     one batch: NLL, KL(dense ‖ view), top-1 per token
score_batches(pruned, batches, views)             many at once, as the model's executor runs them
tally.update(view, source, scores[view])           float64 sums over batches (`evaluation.tally.ViewTally`)
results = view_results(tally, pruned, methods)     the report's `views` section, summed over ranks
evaluate(pruned, views, windows)                   the three above over whole sources, in one call
analysis(pruned, views, windows, calibration)      anatomy and held-out alignment (`ghostdistill.analysis`)
zeroshot(pruned, tokenizer, views, cfg, ...)       lm-eval accuracy per view and task, resumable
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..analysis import analyse
from ..core.executor import executor_of
from ..core.head import output_head, tokens_per_chunk
from ..core.io import json_digest, tensor_digest
from ..core.offload import model_device, onloaded
from ..core.views import DENSE, PRUNED, PrunedModel, view_parameter_count
from ..data import ChatWindows
from ..data.windows import shared_ngrams
from ..distill.parallel import full_tensor
from ..evaluation.metrics import TokenScores, leading_agreement, next_token_targets, score_hidden
from ..evaluation.scores import ScoreStore, score_key
from ..evaluation.tally import ViewTally
from ..evaluation.zeroshot import average_scores, task_limits
from ..methods import get_method
from ..reporting.report import SourceMetrics, ViewResult
from .config import ZeroShotConfig


@torch.no_grad()
def score_views(
    pruned: PrunedModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    views: list[str],
    *,
    chunk: int | None = None,
    counted: torch.Tensor | None = None,
    answers: torch.Tensor | None = None,
) -> dict[str, TokenScores]:
    """NLL of every view in `views`, and KL and top-1 against the dense view, on one batch (1-D over the
    real next-token positions). Each view's decoder runs once and yields final hidden states; logits
    exist only `chunk` tokens at a time (null: sized by the vocabulary, `core.head.tokens_per_chunk`),
    so memory does not grow with batch × vocabulary. `counted` [batch]: rows to score (default all).
    `answers` [batch, seq]: the chat score (`data.run_chat`): only the positions that predict an answer token
    are scored, and each view's `prefix` per answer is given."""
    batch = {"input_ids": ids, "attention_mask": mask, "counted": counted, "answers": answers}
    return score_batches(pruned, [{k: v for k, v in batch.items() if v is not None}], views, chunk=chunk)[0]


@torch.no_grad()
def score_batches(
    pruned: PrunedModel, batches: list[dict[str, torch.Tensor]], views: list[str], *, chunk: int | None = None
) -> list[dict[str, TokenScores]]:
    """`score_views` of each batch ({"input_ids", "attention_mask"?, "counted"?, "answers"?}), the views run as the
    model's executor runs them (`core.executor.view_finals`: a forward per batch, or with the weights offloaded
    block by block over all the batches at once, each block and the head brought onto the device once); the
    scores are the same to the bit."""
    order = [DENSE, *(v for v in views if v != DENSE)]
    heads, modules = {}, []
    for view in order:
        with pruned.use(view) as model:
            heads[view] = output_head(model)  # a student that trains the tail has its own head
            modules.append(model.get_output_embeddings())
    chunk = tokens_per_chunk(pruned.model.get_output_embeddings().weight.shape[0], chunk)
    out = []
    for windows, hidden in executor_of(pruned.model).view_finals(pruned, batches, order):
        with onloaded(*{id(m): m for m in modules}.values()):
            for b, (ids, mask) in enumerate(zip(windows.ids, windows.masks)):
                batch, (targets, valid) = batches[windows.offset + b], next_token_targets(ids, mask)
                if batch.get("counted") is not None:
                    valid = valid & batch["counted"].to(valid.device).bool()[:, None]
                if batch.get("answers") is not None:
                    valid = valid & batch["answers"][:, 1:].to(valid.device).bool()
                states = {view: hidden[view][b][:, :-1] for view in order}
                out.append(score_hidden(states, heads, targets, valid, reference=DENSE, chunk=chunk))
                if batch.get("answers") is not None:  # the chat score: each view's prefix per answer
                    for s in out[-1].values():
                        s.prefix = None if s.top1 is None else leading_agreement(s.top1, valid)
    return out


def view_results(tally: ViewTally, pruned: PrunedModel, methods: dict[str, str | None]) -> dict[str, ViewResult]:
    """The report's `views` section from a complete tally (`compute` sums it over the ranks first); `methods`:
    the method behind each view, for its parameter count."""
    return {
        view: ViewResult(
            params=inference_parameters(pruned, view, methods.get(view)),
            metrics={source: SourceMetrics(**m) for source, m in per_source.items()},
        )
        for view, per_source in tally.compute().items()
    }


def inference_parameters(pruned: PrunedModel, view: str, method: str | None = None) -> int:
    """What the view needs at inference (`core.views.view_parameter_count`), plus the embedding a fold of
    the residual stream into the weights unties from the head (`rotation_through` on a tied model)."""
    total = view_parameter_count(pruned, view)
    if method is not None and get_method(method).folds_embedding:
        embedding, head = pruned.model.get_input_embeddings().weight, pruned.model.get_output_embeddings().weight
        if "meta" in (embedding.device.type, head.device.type):  # offloaded: the config says whether they are one
            tied = bool(getattr(pruned.config, "tie_word_embeddings", False))
        else:
            tied = embedding is head or embedding.data_ptr() == head.data_ptr()
        if tied:
            total += embedding.numel()
    return total


def evaluate(
    pruned: PrunedModel,
    views: list[str],
    windows: dict[str, torch.Tensor | ChatWindows],
    batch_size: int,
    *,
    chunk: int | None = None,
    methods: dict[str, str | None] | None = None,
) -> dict[str, ViewResult]:
    """Every view on every source's windows (a chat source's: `ChatWindows`), in one process (the Lightning
    test loop does the same per batch); `methods` as `view_results`' (`RunConfig.method_of`)."""
    device = model_device(pruned.model)
    tally = ViewTally(views, list(windows), reference=DENSE).to(device)
    for si, source in enumerate(windows.values()):
        batches = [{k: v.to(device) for k, v in batch.items()} for batch in window_batches(source, batch_size)]
        for scores in score_batches(pruned, batches, views, chunk=chunk):
            for view in views:
                tally.update(view, si, scores[view])
    return view_results(tally, pruned, methods or {})


def window_batches(windows: torch.Tensor | ChatWindows, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """A source's windows as batches: ids with a full attention mask, or a chat source's with its masks."""
    if isinstance(windows, ChatWindows):
        parts = [t.split(batch_size) for t in (windows.input_ids, windows.attention_mask, windows.answers)]
        return [{"input_ids": i, "attention_mask": m, "answers": a} for i, m, a in zip(*parts)]
    return [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in windows.split(batch_size)]


@torch.no_grad()
def analysis(
    pruned: PrunedModel, windows: torch.Tensor, calibration: torch.Tensor, batch_size: int, source: str
) -> dict:
    """Anatomy and held-out alignment of every method (`ghostdistill.analysis.analyse`) on `windows`, less
    any that share a 32-token run with the calibration windows (so they are held out even when both come
    from one text)."""
    overlap = set(shared_ngrams(windows, calibration))
    held_out = windows[[i for i in range(len(windows)) if i not in overlap]]
    if len(held_out) == 0:
        return {"held_out_windows": 0, "overlapping_windows": len(overlap), "gaps": {}}
    batches = [{"input_ids": b} for b in held_out.split(batch_size)]
    views = [v for v in pruned.views if v != DENSE]
    return {**analyse(pruned, views, batches), "overlapping_windows": len(overlap), "source": source}


def view_digests(
    pruned: PrunedModel,
    views: list[str],
    model: dict,
    recovery: dict[str, dict],
    fingerprint: str | None,
    step: int = 0,
    students=None,
) -> dict[str, str]:
    """What each view computes, for keying its saved zero-shot scores: `model` (the model settings), the removed
    blocks and the training step (part of the key since the first saved scores, so they stay valid), then for a
    fine-tuned view every trainable tensor of `students` by name, for a training-free method the settings its
    operators were solved from (`fingerprint` of the calibration statistics and `recovery`, name → settings: the
    same solve on another thread count differs in the last bits, which must not void hours of saved scores) or,
    without them, the operators' values."""
    out = {}
    for view in views:
        base = [model, [] if view == DENSE else list(pruned.plan.removed), step]
        trained = students.trainable_state(view) if students is not None and view in students.views else None
        if view in (DENSE, PRUNED):
            out[view] = json_digest(base)
        elif trained is not None:  # a sharded student's whole values (every rank the same key; collective)
            out[view] = json_digest([*base, "trained", tensor_digest({k: full_tensor(t) for k, t in trained.items()})])
        elif view in recovery and fingerprint is not None:
            out[view] = json_digest([*base, fingerprint, recovery[view]])
        else:
            groups = (("operators", pruned.operators), ("mlp_maps", pruned.mlp_maps))
            state = {f"{p}.{k}": v for p, group in groups if view in group for k, v in group[view].state_dict().items()}
            out[view] = json_digest([*base, tensor_digest(state)])
    return out


def zeroshot(
    pruned: PrunedModel,
    tokenizer,
    views: list[str],
    cfg: ZeroShotConfig,
    *,
    digests: dict[str, str] | None = None,
    store: ScoreStore | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, dict]:
    """lm-eval on every view, one task at a time: view → task → scores, with the average. With `store`, each
    (view, task) score is written when done and reused when its key (`digests[view]`, task, limit, data)
    matches."""
    from ..evaluation.zeroshot import evaluate_zeroshot

    limits = task_limits(cfg.tasks, cfg.limit)
    data_dir = str(Path(cfg.data_dir).resolve()) if cfg.data_dir is not None else None
    store = store or ScoreStore(None)
    out = {}
    for view in views:
        scores: dict[str, dict[str, float]] = {}
        for task, limit in limits.items():
            key = score_key((digests or {}).get(view), task, limit, data_dir)
            cached = store.get(view, task, key)
            if cached is not None:
                rows, seconds, how = cached["scores"], cached["seconds"], f"saved in {store.path(view, task)}"
            else:
                start = time.perf_counter()
                with pruned.use(view) as model:
                    result = evaluate_zeroshot(
                        model, tokenizer, [task], data_dir=cfg.data_dir, limit=limit, batch_size=cfg.batch_size
                    )
                seconds, how = round(time.perf_counter() - start, 2), "scored"
                # A group or tag (online) yields one row per subtask; a plain task, its own row.
                rows = {name: dict(row) for name, row in result.items() if name != "average"}
                store.put(view, task, key, {"limit": limit, "seconds": seconds, "scores": rows})
            for name, row in rows.items():
                log(f"zero-shot {view}/{name}: acc {row['acc']:.3f} on {row['n']} items ({how}, {seconds:.0f} s)")
            scores.update(rows)
        scores["average"] = average_scores(scores)
        out[view] = scores
    return out
