"""The paper's analyses on a fitted run: operator anatomy (`anatomy`) and held-out alignment error
(`alignment`), gathered per gap and method by `analyse`."""

from .alignment import AlignmentErrors, analyse, held_out_alignment
from .anatomy import operator_anatomy

__all__ = ["AlignmentErrors", "analyse", "held_out_alignment", "operator_anatomy"]
