"""Text data: sources (`sources`: hub, local files, self-generated), token windows (`windows`), and
conversations through the chat template (`chat`; the dense model's answers, `answers`).

Three places touch data, each for a reason: this package reads text and cuts token windows and knows
no run; `pipeline/data.py` holds a run's data sections (`DataConfig`) and `RunData`, the windows of one run
bound to its tokenizer and cached in its folder; `lit/datamodule.py` is only Lightning's wrapper around
`RunData` (dataloaders, each rank's share of the evaluation windows).
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
