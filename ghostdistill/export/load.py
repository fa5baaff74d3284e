"""Loading an exported folder with ghostdistill's own modelling code (no remote code is run)."""

from __future__ import annotations

import os

from torch import nn

from ..core.modeling_ghostdistill import register_auto_classes


def load_exported(folder: str | os.PathLike, **kwargs) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained(folder, **kwargs)` with the ghost classes registered, so a
    folder with operators loads through this package's copy of `modeling_ghostdistill.py` (the one
    written into the folder) and a plain folder loads as usual.

    Every tensor the model has must come from the folder and every tensor of the folder must find its place:
    a mismatch (a folder written by another version or architecture, a model nested in another) is an error
    naming the tensors, never a model with some weights left at their random initialisation."""
    from transformers import AutoModelForCausalLM

    register_auto_classes()
    kwargs.setdefault("trust_remote_code", False)
    model, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True, **kwargs)
    keys = {"missing_keys": "missing", "unexpected_keys": "unexpected", "mismatched_keys": "of another shape"}
    problems = {what: sorted(info.get(key) or []) for key, what in keys.items()}
    if any(problems.values()):
        found = "; ".join(f"{len(v)} {what} (e.g. {[str(k) for k in v[:3]]})" for what, v in problems.items() if v)
        raise ValueError(
            f"exported folder {folder} does not load whole into {type(model).__name__}: tensors {found}; it was not "
            "written by `ghostdistill export` of a model this version loads, or was changed since; export it again"
        )
    return model.eval()
