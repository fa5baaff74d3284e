"""Options of a plug-in, typed by the plug-in itself (peft's pattern: one config class per method).

A criterion, a student part or an export format may declare `options`, a dataclass whose fields are its own
keys (types, defaults, documented under ``Args:``); a recovery method's keys are its `config` class the same
way. A config names a plug-in's options as a mapping (``plan.criterion_options``, a student's
``part_options: {<part>: {...}}``, ``export.format_options: {<format>: {...}}``), from YAML or the command
line, and `make_options` turns it into that class: a key the plug-in does not declare, or a value outside its
type, is one line naming the plug-in, the key and what is valid. Nothing shared is rebuilt when a plug-in
registers: one registered at any time before a config is read brings its keys.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints


def check_value(key: str, value: Any, hint: Any) -> None:
    """`value` has the type `hint` allows for the shapes an option takes: a choice (``Literal``), a bool, a
    number, a string or a list of them; a value outside it is one line naming the key, the value and what is
    valid. Other hints are not checked here (the class's `validate` may)."""
    if get_origin(hint) in (Union, types.UnionType):
        if value is None and type(None) in get_args(hint):
            return
        hint = next((a for a in get_args(hint) if a is not type(None)), hint)
    if get_origin(hint) is Literal:
        if value not in get_args(hint):
            raise ValueError(f"{key} {value!r} is not known; choose one of {get_args(hint)}")
    elif hint is bool and not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    elif hint in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{key} must be a number, got {value!r}")
    elif hint is int and not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    elif hint is str and not isinstance(value, str):
        raise ValueError(f"{key} must be a string, got {value!r}")
    elif get_origin(hint) is list:
        if not isinstance(value, list):
            raise ValueError(f"{key} must be a list, got {value!r}")
        for item in value:
            check_value(key, item, (get_args(hint) or (Any,))[0])


def check_options_class(cls: Any, where: str) -> None:
    """Refuse an `options` that is not a dataclass with a default for every field (what a config that omits a
    key gets), naming the plug-in."""
    if cls is None:
        return
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{where}: options {cls!r} must be a dataclass (its fields are the plug-in's keys)")
    unset = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
             and f.default_factory is dataclasses.MISSING]  # fmt: skip
    if unset:
        raise ValueError(f"{where}: options {unset} of {cls.__name__} need a default")


def make_options(cls: Any, values: Mapping | None, where: str) -> Any:
    """`values` as the plug-in's options class `cls` (its defaults where a key is not given), every key and
    value checked, then the class's own `validate()` if it has one; None where the plug-in declares none and
    nothing is given. `where` names the plug-in in messages (``plan.criterion_options (deepest_first)``)."""
    values = dict(values or {})
    if cls is None:
        if values:
            raise ValueError(f"{where}: takes no options; remove {sorted(values)}")
        return None
    hints = get_type_hints(cls)
    keys = [f.name for f in dataclasses.fields(cls)]
    try:
        for key, value in values.items():
            if key not in keys:
                raise ValueError(f"key {key!r} is not one of its options; its keys are: {', '.join(keys)}")
            check_value(key, value, hints[key])
        out = cls(**values)
        getattr(out, "validate", lambda: None)()
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return out
