"""Fine-tuned recovery: distilling the pruned students against the dense teacher. What a student trains is
one registered `Part` per kind (`interface.py`; the shipped ones in `parts.py`, registered on import)."""

from . import parts  # noqa: F401  (the registry of student parts)
from .interface import Part, get_part, register, unregister
from .interface import parts as part_names

__all__ = ["Part", "get_part", "part_names", "register", "unregister"]
