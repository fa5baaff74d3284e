"""Text data: sources (`sources`: hub, local files, self-generated) and token windows (`windows`)."""

from .sources import GENERATE, HUB_SOURCES, TextSource, load_documents, validate_source
from .windows import calibration_windows, evaluation_windows, generate_windows, shared_ngrams, tokenize_documents

__all__ = [
    "GENERATE",
    "HUB_SOURCES",
    "TextSource",
    "calibration_windows",
    "evaluation_windows",
    "generate_windows",
    "load_documents",
    "shared_ngrams",
    "tokenize_documents",
    "validate_source",
]
