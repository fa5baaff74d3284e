"""Text data: sources (`sources`: hub, local files, self-generated), token windows (`windows`), and
conversations through the chat template (`chat`; the dense model's answers, `answers`), and a run's data:
its sections (`config.DataConfig`) and `run.RunData`, the windows of one run bound to its tokenizer and cached
in its folder (its chat sources and chat score: `run_chat`).

`lit/datamodule.py` is only Lightning's wrapper around `RunData` (dataloaders, each rank's share of the
evaluation windows).
"""

from .answers import ChatWindows
from .sources import GENERATE, ChatSettings, TextSource, load_documents, validate_source
from .windows import calibration_windows, disjoint_windows, evaluation_windows, generate_windows, shared_ngrams

__all__ = [
    "ChatSettings",
    "ChatWindows",
    "GENERATE",
    "TextSource",
    "calibration_windows",
    "disjoint_windows",
    "evaluation_windows",
    "generate_windows",
    "load_documents",
    "shared_ngrams",
    "validate_source",
]
