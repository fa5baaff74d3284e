"""Bytes of the calibration statistics of one gap, before and after sizing the collectors to the run.

For each case (a list of recovery entries) the gap's collectors are made as before (every collector
holds everything: `make_collectors(methods, C, device)`) and sized to the entries
(`make_collectors(methods, C, device, recovery)`), fed one small random batch, and measured as the sum
of `element_size() * numel()` over the tensors of their `state_dict()` (what `calibration_state.pt`
holds per gap, and what the accumulators occupy). Prints one JSON line per case.

    python scripts/statistics_bytes.py [--hidden 4096] [--tokens 64] [--device cpu]
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from ghostdistill.methods import GapTaps, RecoveryConfig, make_collectors, statistics_layout, validate_recovery

VARIANTS = ("first_weighted", "first", "first_normed", "plain", "weighted")
CASES: dict[str, list[RecoveryConfig]] = {
    # The default config: one ghost entry, fit first_weighted.
    "default_ghost": [RecoveryConfig()],
    # configs/smollm2_demo.yaml
    "demo_ghost_and_ghost_paper": [RecoveryConfig(name="ghost"), RecoveryConfig(name="ghost_paper", fit="plain")],
    # Every fit variant: the one-pass, all-variants collector.
    "all_ghost_variants": [RecoveryConfig(name=f"ghost_{f}", fit=f) for f in VARIANTS],
    # configs/studies/fit-variants/smollm2_variants.yaml (its ghost entries fit first_weighted, first and first_normed)
    "smollm2_variants_yaml": [
        RecoveryConfig(name="ghost", fit="first_weighted"),
        RecoveryConfig(name="ghost_first", fit="first"),
        RecoveryConfig(name="ghost_normed", fit="first_normed"),
        RecoveryConfig(name="ghost_ridge1e-2", ridge=0.01),
        RecoveryConfig(name="ghost_ridge1e-1", ridge=0.1),
        RecoveryConfig(name="ghost_bias", bias=True),
        RecoveryConfig(name="ghost_scale", scale="norm"),
        RecoveryConfig(name="ghost_symmetric", method="ghost_symmetric"),
        RecoveryConfig(name="linearpatch", method="linearpatch", variant="rotate"),
    ],
    "linearpatch": [RecoveryConfig(name="linearpatch", method="linearpatch")],
}


def state_nbytes(state) -> int:
    if isinstance(state, dict):
        return sum(state_nbytes(v) for v in state.values())
    if isinstance(state, torch.Tensor):
        return state.element_size() * state.numel()
    return 0


def taps(hidden: int, tokens: int, device: str) -> GapTaps:
    g = torch.Generator().manual_seed(0)
    batch, seq = 2, max(tokens // 2, 2)
    x = torch.randn(batch, seq, hidden, generator=g)
    post = x + 0.1 * torch.randn(batch, seq, hidden, generator=g)
    first = torch.zeros(batch, seq, dtype=torch.bool)
    first[:, 0] = True
    return GapTaps(x.to(device), post.to(device), torch.ones(batch, seq, device=device), first.to(device))


def measure(recovery: list[RecoveryConfig] | None, methods: set[str], t: GapTaps, hidden: int, device: str) -> int:
    collectors = make_collectors(methods, hidden, device, recovery)
    for c in collectors.values():
        c.update(t)
    nbytes = sum(state_nbytes(c.state_dict()) for c in collectors.values())
    del collectors
    gc.collect()
    return nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    t = taps(args.hidden, args.tokens, args.device)
    for name in args.cases:
        recovery = CASES[name]
        validate_recovery(recovery)
        methods = {r.method for r in recovery}
        before = measure(None, methods, t, args.hidden, args.device)
        after = measure(recovery, methods, t, args.hidden, args.device)
        row = {
            "case": name,
            "hidden": args.hidden,
            "entries": [r.name for r in recovery],
            "before_bytes": before,
            "after_bytes": after,
            "before_GB": round(before / 1e9, 3),
            "after_GB": round(after / 1e9, 3),
            "ratio": round(after / before, 4),
            "sized_layout": statistics_layout(methods, recovery),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
