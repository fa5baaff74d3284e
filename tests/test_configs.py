"""The shipped configs' layout: product examples in configs/, each study reproduction under the results page that
reports it (configs/studies/<page>/), and the protocol the studies share written once (configs/studies/protocol/),
which no study repeats or silently departs from."""

import re
import typing

import pytest
import yaml
from shipped_configs import CONFIGS, PRODUCT, PROTOCOL, ROOT, SECTIONS, SHIPPED, STUDIES, STUDY, included

from ghostdistill.core.model import ModelConfig
from ghostdistill.data.config import DataConfig
from ghostdistill.runner.config import parse_fit, typed

FIT_STUDIES = [p for p in STUDY if "base" not in yaml.safe_load(p.read_text())]
TYPES = {("model", "model"): ModelConfig} | {
    ("data", key): cls for key, cls in typing.get_type_hints(DataConfig).items() if ("data", key) in SECTIONS
}


def protocol(top: str, key: str):
    """The protocol's section, typed as `fit` parses it."""
    return typed(TYPES[top, key], yaml.safe_load(SECTIONS[top, key].read_text()), str(SECTIONS[top, key]))


def section(parsed, top: str, key: str):
    """A parsed config's section (`model.model` is the run config's `model`)."""
    return parsed.cfg.model if (top, key) == ("model", "model") else getattr(parsed.cfg.data, key)


def test_every_config_is_a_product_example_or_under_a_results_page():
    assert {p.name for p in PRODUCT} >= {"smollm2_demo.yaml", "llama3_11.yaml"} and len(STUDY) > 20
    assert sorted(p.name for p in PROTOCOL.glob("*.yaml")) == sorted(f.name for f in SECTIONS.values())
    assert set(SHIPPED) == set(PRODUCT) | set(STUDY)
    for path in STUDY:
        page = ROOT / "docs" / "results" / f"{path.parent.name}.md"
        assert path.parent.parent == STUDIES and page.is_file(), f"{path}: no results page {page.name}"


@pytest.mark.parametrize("path", STUDY, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_study_config_is_named_by_its_page_or_by_a_file_the_page_names(path):
    """The page that reports a study names its config, or the compare/frontier file whose base it is."""
    page = (ROOT / "docs" / "results" / f"{path.parent.name}.md").read_text()
    rel = str(path.relative_to(ROOT))
    named = {m for m in re.findall(r"configs/[\w/.-]+\.yaml", page)}
    users = {
        str(p.relative_to(ROOT))
        for p in STUDY
        if rel
        in (
            yaml.safe_load(p.read_text()).get("base"),
            (yaml.safe_load(p.read_text()).get("students") or {}).get("config"),
        )
    }
    assert rel in named or users & named, f"docs/results/{path.parent.name}.md names neither {rel} nor {sorted(users)}"


@pytest.mark.parametrize("path", FIT_STUDIES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_study_takes_each_protocol_section_from_its_file_or_writes_one_that_differs(path, monkeypatch):
    """Each section a study writes out departs from the protocol (a copy of it must name the protocol's file
    instead, so the protocol is written once), and a section it names by file parses to the protocol's values."""
    monkeypatch.chdir(ROOT)
    parsed = parse_fit(["--config", str(path)], str(path))
    for top, key in SECTIONS:
        source = included(path, top, key)
        if source is not None:
            assert source == SECTIONS[top, key].resolve(), f"{path.name}: {top}.{key} is read from {source}"
            assert section(parsed, top, key) == protocol(top, key), f"{path.name}: {top}.{key}"
        else:
            assert section(parsed, top, key) != protocol(top, key), (
                f"{path.name}: {top}.{key} repeats the protocol: write `{key}: ../protocol/{key}.yaml` instead"
            )


def test_every_protocol_section_is_used_and_the_product_examples_stand_alone():
    """A user copies a product example: it names no file for a section. configs/smollm2_serving.yaml says its
    training-free rows equal docs/results/compare.md's cells, so it keeps the protocol's calibration and
    evaluation, written out."""
    for top, key in SECTIONS:
        assert any(included(p, top, key) for p in FIT_STUDIES), f"nothing includes {SECTIONS[top, key].name}"
    for path in PRODUCT:
        assert not any(included(path, top, key) for top, key in SECTIONS), path.name
    serving = parse_fit(["--config", str(CONFIGS / "smollm2_serving.yaml")], "serving")
    for top, key in [("data", "calibration"), ("data", "evaluation")]:
        assert section(serving, top, key) == protocol(top, key), key
