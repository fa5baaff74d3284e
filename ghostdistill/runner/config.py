"""A `fit` config as typed objects, without a Trainer: what `compare`, `frontier` (its students too) and
`export <run>` run or read.

    parsed = parse_fit(args, who)           the arguments parsed as `fit` parses them, nothing instantiated
    run = parsed.replace(root, plan=...)    the same config, other sections (`dataclasses.replace`), another root
    run.settings()                          what decides its results, as its results.json records (`result_settings`)
    run.fit()                               the run itself (`fit.run_fit` of its config): its `pipeline.run.Run`
    run_config_of(config)                   a config mapping's `RunConfig` (a run folder's config.yaml)

A `ParsedFit` is the typed `RunConfig` and the rest of the config (seed, trainer, callbacks) as jsonargparse
gives it; its `config()` is the mapping `fit` takes, so a run of it is parsed and checked like any `fit`.
"""

from __future__ import annotations

import copy
import inspect
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..data.config import DataConfig
from ..methods import RecoveryConfig
from ..pipeline.config import RunConfig
from ..pipeline.run import Run
from ..pipeline.settings import result_settings
from .fit import _ParseOnly, argument_line, build_fit, run_fit


def _drop_none(value: Any) -> Any:
    """What jsonargparse's dump leaves out: every key whose value is None, at any depth."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _instantiate(parser, value: dict, who: str):
    """`value` parsed by `parser` and its classes made: an unknown key or a bad value is one line naming it and
    `who`."""
    from jsonargparse import ArgumentError

    try:
        parsed = parser.parse_object(copy.deepcopy(value))
    except ArgumentError as err:
        raise ValueError(f"{who}: {argument_line(err)}") from None
    return (getattr(parser, "instantiate", None) or parser.instantiate_classes)(parsed)


def run_config_of(config: dict, who: str = "config") -> RunConfig:
    """The `RunConfig` of a `fit` config mapping (its `model` and `data` sections), parsed and checked as `fit`
    parses them. Nothing is loaded."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(RunConfig, "model", skip={"data"})
    parser.add_class_arguments(DataConfig, "data")
    built = _instantiate(parser, {"model": config.get("model") or {}, "data": config.get("data") or {}}, who)
    return replace(built.model, data=built.data)


def typed(cls: type, value: dict, who: str):
    """A mapping as a config dataclass `cls`, parsed and checked as `fit` parses it."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--value", type=cls)
    return _instantiate(parser, {"value": value}, who).value


@dataclass
class ParsedFit:
    """A parsed `fit`: its run config and the rest of its config (seed, trainer, callbacks, ckpt_path)."""

    cfg: RunConfig
    rest: dict

    def config(self) -> dict:
        sections = json.loads(json.dumps(asdict(self.cfg), default=_plain))
        return {**copy.deepcopy(self.rest), "data": sections.pop("data"), "model": sections}

    def settings(self) -> dict:
        return result_settings(_drop_none(self.config()))

    def replace(self, root: str | Path | None = None, **sections) -> ParsedFit:
        rest = copy.deepcopy(self.rest)
        if root is not None:
            rest.setdefault("trainer", {})["default_root_dir"] = str(root)
        return ParsedFit(replace(self.cfg, **sections), rest)

    def fit(self, ckpt_path: str | None = None, overwrite: bool = False) -> Run:
        """Run this `fit` (distil when it has steps, evaluate, report, export) in its run folder: `fit.run_fit`
        of its config. `ckpt_path`: ``last`` resumes an interrupted one; `overwrite`: replace the results of
        other settings there (`fit --overwrite_run`). Returns its `Run` (the report in memory)."""
        config = self.config()
        if ckpt_path is not None:
            config["ckpt_path"] = ckpt_path
        if overwrite:
            config["overwrite_run"] = True
        return run_fit(config).model.run


def _plain(obj):
    return obj.as_dict() if isinstance(obj, RecoveryConfig) else str(obj)


def parse_fit(args: list[str], who: str) -> ParsedFit:
    """`args` parsed as `fit` parses them, nothing instantiated (no tokenizer, no trainer); a bad argument is
    one line naming `who`."""
    from jsonargparse import ArgumentError

    try:
        cli = build_fit(args, cli_class=_ParseOnly, exit_on_error=False)
    except ArgumentError as err:
        raise ValueError(f"{who}: {argument_line(err)}") from None
    keep = "skip_unset" if "skip_unset" in inspect.signature(cli.parser.dump).parameters else "skip_none"
    config = json.loads(cli.parser.dump(cli.config, format="json", **{keep: False}))
    return ParsedFit(run_config_of(config, who), {k: v for k, v in config.items() if k not in ("model", "data")})
