"""What a recovery method may need to know of a model family before any work: `FamilyFacts`.

A method whose construction holds only for some block layouts says so in its own class
(`Method.supports(cfg, family)`: None, or why it cannot be right on this family), and a run refuses such an entry
before calibration, in one line (`methods.config.check_family`), instead of calibrating, fitting and evaluating a
view that is wrong by construction (issue 53: `rotation_anchored` on Gemma 3 ran to the end, perplexity 5982
against the pruned model's 292, and its export then refused the fold).

What the families differ in, for the shipped methods (docs/reliability.md, "What applies to which family"):

| family                      | block layout                                                    |
|-----------------------------|-----------------------------------------------------------------|
| LLaMA, Mistral, Qwen2, Qwen3 | pre-norm: h ← h + attn(n₁(h)); h ← h + mlp(n₂(h)), RMSNorm γ ⊙ x/rms(x) |
| Gemma 2, Gemma 3            | a norm also ends each branch: h ← h + n₃(attn(n₁(h))); h ← h + n₄(mlp(n₂(h))), norms x/rms(x)·(1 + γ) |

The facts are read from one decoder block's layout (its class and the norms it holds), never its weights: a
block of a meta-device skeleton built from the config alone gives the same answer as a loaded one.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..core.anatomy import decoder_stack, hidden_size, text_config
from ..core.sharded import plain_class


@dataclass(frozen=True)
class FamilyFacts:
    """A model family as the capability checks see it: `model_type` (what messages name), one decoder `block`
    (only its layout is read) and the hidden size."""

    model_type: str
    block: nn.Module
    hidden_size: int

    @property
    def block_class(self) -> str:
        """The block's class name (FSDP2's ``FSDP<Class>`` wrapper left out)."""
        return plain_class(self.block).__name__


def family_facts(model: nn.Module) -> FamilyFacts:
    """The facts of `model`'s family (a loaded model, offloaded or sharded, or a meta-device skeleton)."""
    return FamilyFacts(
        model_type=str(getattr(text_config(model), "model_type", None) or type(model).__name__),
        block=decoder_stack(model).layers[0],
        hidden_size=hidden_size(model),
    )
