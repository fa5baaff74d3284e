"""Exported views: Hugging Face model folders (`writer`), their model cards (`card`), loading (`load`).

`model.view_model`: a view as a `transformers` model in memory, the model its folder loads as.
GGUF files for llama.cpp (`gguf`, `gguf_vocab`) and folding rotations into weights (`fold`) live here
too, and what an export is asked and can check with no run (`options`). Which views a run has, and writing them
from a run in memory or from its folder, need the run's config, above this package: `pipeline.export` and
`pipeline.reload`.
"""

from .load import load_exported
from .model import view_model
from .writer import export_view

__all__ = ["export_view", "load_exported", "view_model"]
