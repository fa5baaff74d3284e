"""The shipped configs: the product examples in configs/, the study reproductions in configs/studies/<page>/
(<page>: the docs/results page that reports them), and the protocol the studies share, written once in
configs/studies/protocol/ (one file per section, each a section's values, not a config).

A study config names a protocol section by its file, e.g. `data: {calibration: ../protocol/calibration.yaml}`:
jsonargparse reads the values of a class's argument group (a dataclass section here) from a file given in its
place, relative to the config that names it. `raw` is a config's YAML with those files read in."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
STUDIES = CONFIGS / "studies"
PROTOCOL = STUDIES / "protocol"
# Every config a command reads (fit configs, compare and frontier files); the protocol's files are parts of them.
SHIPPED = sorted(p for p in CONFIGS.rglob("*.yaml") if PROTOCOL not in p.parents)
STUDY = [p for p in SHIPPED if STUDIES in p.parents]
PRODUCT = [p for p in SHIPPED if p.parent == CONFIGS]
# The sections a study config can take from the protocol: (top-level section, key) -> the protocol's file.
SECTIONS = {("model", "model"): PROTOCOL / "model.yaml"} | {
    ("data", key): PROTOCOL / f"{key}.yaml" for key in ("calibration", "evaluation", "selection", "train", "validation")
}


def included(path: Path, top: str, key: str) -> Path | None:
    """The file `path`'s section `top.key` is read from (resolved), or None where the config writes it out."""
    value = ((yaml.safe_load(path.read_text()) or {}).get(top) or {}).get(key)
    return (path.parent / value).resolve() if isinstance(value, str) else None


def raw(path: Path) -> dict:
    """`path`'s YAML, each section it names by a file replaced by that file's values."""
    config = yaml.safe_load(path.read_text()) or {}
    for top, key in SECTIONS:
        source = included(path, top, key)
        if source is not None:
            config[top][key] = yaml.safe_load(source.read_text())
    return config
