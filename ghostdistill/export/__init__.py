"""Exported views: Hugging Face model folders (`writer`), their model cards (`card`), loading (`load`).

`model.view_model`: a view as a `transformers` model in memory, the model its folder loads as.
GGUF files for llama.cpp (`gguf`, `gguf_vocab`) and folding rotations into weights (`fold`) live here
too. Why `pipeline/export.py` is not here: this package writes one view, given in memory, as files; which
views of a run may be exported, in which formats, to which checked targets, and with what provenance are a
run's questions, answered in `pipeline` (and a finished run folder is rebuilt by `pipeline.reload`).
"""

from .load import load_exported
from .model import view_model
from .writer import export_view

__all__ = ["export_view", "load_exported", "view_model"]
