"""float32 and bfloat16 matrix products on this machine's CPU in the three layouts a linear layer's forward and
backward use, side by side: x·Wᵀ (forward), g·W (the input's gradient) and gᵀ·x (the weight's gradient), for
x, g of 512 × 4096 and W of 4096 × 4096. On a CPU without bfloat16 arithmetic (no AVX-512 BF16 or AMX) the
bfloat16 g·W takes a scalar path; this is why scripts/rehearsal_8b.py runs bfloat16 there with short windows.

    .venv/bin/python scripts/benchmark_bf16_gemm.py
"""

from __future__ import annotations

import time

import torch


def seconds(f, n: int = 3) -> float:
    f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n


def main() -> None:
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}; seconds per product (mean of 3 after a warm-up)")
    print("| dtype | x·Wᵀ | g·W | gᵀ·x |")
    print("|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(512, 4096, dtype=dtype)
        w = torch.randn(4096, 4096, dtype=dtype)
        g = torch.randn(512, 4096, dtype=dtype)
        times = (
            seconds(lambda x=x, w=w: torch.nn.functional.linear(x, w)),
            seconds(lambda g=g, w=w: g @ w),
            seconds(lambda g=g, x=x: g.t() @ x),
        )
        print(f"| {str(dtype).removeprefix('torch.')} | " + " | ".join(f"{t:.3f}" for t in times) + " |")


if __name__ == "__main__":
    main()
