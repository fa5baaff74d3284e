"""What a run folder may make `export` load or run: its `config.yaml` is someone else's file.

A run folder can be copied from anyone. `export <run>` rebuilds the run from its `config.yaml`, so that
file decides what gets loaded; it must not decide what gets executed. Two things in it would:

- `model.model.trust_remote_code: true`: transformers then imports the Python files the model source
  ships (`configuration_*.py`, `modeling_*.py`, `tokenization_*.py`) while the tokenizer and the model
  load, and with a hub id it downloads them first. It is honoured only when the user passes
  `--trust-remote-code` on the `export` command line; otherwise export refuses with one line naming
  the flag. Without it the model loads with `trust_remote_code=False`, so a source folder that ships code
  is read through transformers' own classes (or refused by transformers) and its files are never imported.
- the `trainer` section: jsonargparse imports and instantiates every `class_path` it names (callbacks,
  loggers, strategies, plugins, profilers). Export needs no trainer, so `export_sections` keeps only the
  run folder (`trainer.default_root_dir`); the rest of the section is never read.

Everything else the config names is data: a registered method name, a text file or one of the fixed
hub data sets (`data.sources`, no loading scripts), a GGUF file, safetensors weights; checkpoints and
statistics load with `torch.load(weights_only=True)`. Folders written by `ghostdistill export` ship
`modeling_ghostdistill.py`, but ghostdistill loads them with its own copy of that code
(`core.modeling_ghostdistill`), without remote code.
"""

from __future__ import annotations

from pathlib import Path

FLAG = "--trust-remote-code"
# The config.yaml sections export reads; `trainer` only for its run folder (see the module docstring).
SECTIONS = ("seed_everything", "model", "data")


def remote_code_requests(config: dict) -> list[str]:
    """The settings of a run's config.yaml that would run code the run folder names, each as
    ``key: value`` (empty when there are none)."""
    model = (config.get("model") or {}) if isinstance(config.get("model"), dict) else {}
    source = model.get("model") if isinstance(model.get("model"), dict) else {}
    if not source.get("trust_remote_code"):
        return []
    return [f"model.model.trust_remote_code: true (model.model.source {source.get('source')!r})"]


def check_trust(config: dict, where: Path, trusted: bool) -> None:
    """Refuse a run config that asks to run code, unless the user passed `--trust-remote-code`."""
    requests = remote_code_requests(config)
    if requests and not trusted:
        raise PermissionError(
            f"{where} asks to run the model's own Python code ({'; '.join(requests)}): export runs code a run "
            f"folder names only when you pass {FLAG} on the command line (do so only if you trust its author)"
        )


def export_sections(config: dict, run: Path) -> dict:
    """The sections of a run's config.yaml that export reads: the model, data and seed; of the trainer,
    only the run folder (its classes are never imported)."""
    saved = {k: v for k, v in config.items() if k in SECTIONS}
    saved["trainer"] = {"default_root_dir": str(run)}
    return saved
