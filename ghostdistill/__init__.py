"""ghostdistill: make layer-pruned causal LMs good again.

Remove whole decoder blocks, then repair each gap with a closed-form linear "ghost" operator
(training-free), optionally followed by distillation against the dense teacher.

From Python (`ghostdistill.api`): `repair`, `plan`, `evaluate`, `distill_student`, `load`, `compare`,
`frontier`, and `GhostdistillError`, imported on first use so that `import ghostdistill` (and the command
line) stays light.
"""

from .core.errors import GhostdistillError

__version__ = "0.1.0"
__all__ = ["GhostdistillError", "compare", "distill_student", "evaluate", "frontier", "load", "plan", "repair"]

_API = ("Options", "compare", "distill_student", "evaluate", "frontier", "load", "plan", "repair")


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'ghostdistill' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API, *__all__])
