"""The paper's analyses on a fitted run: operator anatomy (`anatomy`) and held-out alignment error
(`alignment`), gathered per gap and method by `analyse`.

Why three places: this package computes the analyses from a fitted model and batches;
`pipeline.evaluate.analysis` picks the held-out windows of a run they read (none sharing a 32-token run with
calibration); `reporting/analysis.py` writes them into results.md and analysis.png. Computing, choosing a
run's inputs and writing files are three layers, so each goes where its layer is.
"""

from .alignment import AlignmentErrors, analyse, held_out_alignment
from .anatomy import operator_anatomy

__all__ = ["AlignmentErrors", "analyse", "held_out_alignment", "operator_anatomy"]
