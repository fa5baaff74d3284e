"""Folding scaled rotations of the residual stream into the weights of a pre-norm RMSNorm model.

SliceGPT's computational invariance (arXiv 2401.15024). Row vectors throughout; a torch `nn.Linear`
computes x·Wᵀ + b. A `rotation_through` operator at a gap maps every token x ← x·T, T = c·Q (Q orthogonal,
c > 0), on the residual stream entering the first block after the gap.

One block: h ← h + o_proj(attn(n₁(h))); h ← h + down_proj(mlp(n₂(h))), with RMSNorm n(h) = γ ⊙ h/rms(h).
"Transforming a block by S = a·R" (R orthogonal, a > 0) means: it reads and writes the stream h·S and
computes from it what it computed from h, times S:

- rms(h·S) = a·rms(h), so with γ = 1, n(h·S) = n(h)·R exactly for RMSNorm without ε; so first absorb γ
  into the linears that read the norm (W_in ← W_in·diag(γ), γ ← 1);
- a linear reading the norm then needs (z·R)·W'ᵀ = z·W_inᵀ, i.e. **W' = W_in·R** (q/k/v after
  input_layernorm, gate/up after post_attention_layernorm; their biases, Qwen2's q/k/v, are unchanged);
- a linear writing to the stream needs o' = o·S, i.e. **W' = Sᵀ·W_out** and b' = b·S (o_proj, down_proj).

Qwen3's q_norm / k_norm act per head on q_proj / k_proj's outputs, which this does not change: exact.
Transforming by S then by S' is transforming by S·S' (W_in·R·R', S'ᵀ·Sᵀ·W_out = (S·S')ᵀ·W_out).

Where the gap's c goes. The view's stream after the gap is v·c·Q and the folded model has no operator:
transforming everything before the gap by c·Q (embedding E ← E·c·Q) is one exact choice, and so is
transforming everything before by Q only and every block after by 1/c (its writes ÷ c, as `magnitude`
folds: it reads through a scale-invariant norm; the final norm removes the factor). The two differ only through RMSNorm's ε: a norm
reading the stream scaled by a computes x/√(a²·ms + ε) instead of x/(a·√(ms + ε)), a relative change of
about ε·|1 − 1/a²|/(2·ms). The scale is put where ms is large: before the gap the stream includes the
embedding (ms ≈ 1e-4 in small models, comparable to ε = 1e-6 … 1e-5), after it the stream has grown.
So the fold puts the rotation before the gap (exact) and the scale after it (ε-small), except for a gap
at block 0: there the stream after the gap is still embedding-sized, and the embedding, which no norm
reads before the gap, takes all of c·Q (exact).

Several gaps g₁ < … < gₙ with T_k = c_k·Q_k: folding them one by one in plan order (first to last), each
transforming the blocks before it by Q_k and those after it by 1/c_k, transforms the segment after g_j
(before g_{j+1}) by S_j = (1/(c₁⋯c_j))·Q_{j+1}⋯Qₙ, and the embedding by S₀ = Q₁⋯Qₙ (`folded_embedding`;
with g₁ at block 0, c₁ moves from every S_j into S₀: S₀ = c₁·Q₁⋯Qₙ, S_j = (1/(c₂⋯c_j))·Q_{j+1}⋯Qₙ).
That is right: the folded stream in segment j must be the view's times S_j with S_{k−1} = T_k·S_k (no
operator at g_k), and T_k·S_k = c_k·Q_k·(1/(c₁⋯c_k))·Q_{k+1}⋯Qₙ = S_{k−1}; the last segment's S_n is a
scalar, which the final norm absorbs. (With all of each T_k before its gap, the same recursion gives
S_j = T_{j+1}⋯Tₙ, S_n = I: processing gaps from last to first, Tₙ applies to everything before gₙ, the
earlier operators included, T_k becoming Tₙ⁻¹·T_k·Tₙ, still a scaled rotation.)
A tied head keeps the original E: the embedding is untied, which costs vocab × hidden parameters.

Only the families whose block layout this derivation covers fold (llama, mistral, qwen2, qwen3: two
pre-norms, no norm inside the residual branch, plain γ ⊙ x/rms(x) RMSNorm, unscaled embedding); any
other is refused naming the reason (Gemma's post-norms inside the residual branch see the branch output,
not the stream, so the stream's rotation does not commute with them; its (1 + γ) norm and scaled
embedding differ too).
"""

from __future__ import annotations

import torch

# The blocks' side of the fold is the method's (`RotationThrough.fold`, called by the writer gap by gap);
# this module adds what the writer owns: the embedding (`export.pieces` unties the head and the config).
from ..methods.rotation import scaled_rotation


def residual_product(plan, operators) -> torch.Tensor | None:
    """S₀ = Q₁·Q₂⋯Qₙ over the plan's gaps (float64; c₁·Q₁⋯Qₙ when the first gap starts at block 0), or
    None without gaps."""
    product = None
    for gap in plan.gaps:
        c, t, _ = scaled_rotation(operators[gap.key])
        t = c * t if gap.start == 0 else t
        product = t if product is None else product @ t.to(product.device)
    return product


# Rows of the embedding folded at a time: E·S₀ in float64 for a 128k vocabulary at 4096 would hold 4 GiB at once.
FOLD_ROWS = 8192


@torch.no_grad()
def folded_embedding(weight: torch.Tensor, product: torch.Tensor | None) -> torch.Tensor:
    """E·S₀ in float64, `FOLD_ROWS` rows at a time, in E's dtype (E itself when there is no gap)."""
    if product is None:
        return weight
    product = product.to(weight.device)
    out = torch.empty_like(weight)
    for lo in range(0, weight.shape[0], FOLD_ROWS):
        out[lo : lo + FOLD_ROWS] = (weight[lo : lo + FOLD_ROWS].to(torch.float64) @ product).to(weight.dtype)
    return out
