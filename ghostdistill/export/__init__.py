"""Exported views: Hugging Face model folders (`writer`), their model cards (`card`), loading (`load`)."""

from .load import load_exported
from .writer import export_view

__all__ = ["export_view", "load_exported"]
