"""Loading an exported folder with ghostdistill's own modelling code (no remote code is run)."""

from __future__ import annotations

import os

from torch import nn

from ..core.modeling_ghostdistill import register_auto_classes


def load_exported(folder: str | os.PathLike, **kwargs) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained(folder, **kwargs)` with the ghost classes registered, so a
    folder with operators loads through this package's copy of `modeling_ghostdistill.py` (the one
    written into the folder) and a plain folder loads as usual."""
    from transformers import AutoModelForCausalLM

    register_auto_classes()
    kwargs.setdefault("trust_remote_code", False)
    return AutoModelForCausalLM.from_pretrained(str(folder), **kwargs).eval()
