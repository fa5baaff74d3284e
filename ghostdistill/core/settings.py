"""What a config key means for saved results, marked on the key where it is defined (a dataclass field):

- a result key (an ordinary field): a saved result computed with another value is stale;
- `cost_only`: it changes what a run costs (memory, time, where files go), never what it computes; no
  digest or comparison of settings holds it;
- `added_later`: a key that saved results predate: while it is unset (None) a digest leaves it out, so they
  keep their keys (it must default to None).

`pipeline.settings` reads these marks for every digest and comparison of a run's settings; `PlanConfig`'s
plan digest reads them here (`digest_dict`). Other marks a field may carry are other modules' (`tag`:
`compare`'s folder names).
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, Field, asdict, fields
from typing import Any, get_type_hints

COST = "cost_only"
LATER = "added_later"


def setting(default: Any = MISSING, *, cost: bool = False, later: bool = False, **marks: Any) -> Any:
    """A dataclass field with marks: `cost` (cost-only), `later` (added later), and others (`tag`)."""
    if later and default is not None:
        raise ValueError("a key added later defaults to None (unset), which digests leave out")
    return dataclasses.field(default=default, metadata={COST: cost, LATER: later, **marks})


def cost_only(default: Any = None, **marks: Any) -> Any:
    return setting(default, cost=True, **marks)


def is_cost(f: Field) -> bool:
    return bool(f.metadata.get(COST))


def is_later(f: Field) -> bool:
    return bool(f.metadata.get(LATER))


def cost_keys(cls: type, prefix: str = "") -> list[str]:
    """The dotted names of the cost-only keys of the dataclass `cls` and of the dataclasses its fields hold."""
    hints = get_type_hints(cls)
    out = []
    for f in fields(cls):
        if is_cost(f):
            out.append(prefix + f.name)
        elif dataclasses.is_dataclass(hints[f.name]):
            out += cost_keys(hints[f.name], f"{prefix}{f.name}.")
    return out


def digest_dict(obj: Any) -> dict:
    """A dataclass's settings for a digest: every field but the cost-only ones, and the ones added later
    only when set."""
    values = asdict(obj)
    return {
        f.name: values[f.name] for f in fields(obj) if not is_cost(f) and not (is_later(f) and values[f.name] is None)
    }
