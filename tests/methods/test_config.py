"""Per-method configuration: each method reads its own keys of `RecoveryConfig` (its config class's fields,
with their defaults); a key it does not read is rejected naming the key and the method's keys, unset keys resolve to
the defaults every fit saw before the keys were split, and every shipped config still validates."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import yaml
from conftest import random_batches, tiny_model
from shipped_configs import SHIPPED

from ghostdistill.calibration.fit import fit_methods
from ghostdistill.calibration.stream import accumulate
from ghostdistill.core.io import json_digest
from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import PrunedModel
from ghostdistill.distill.config import DistillConfig
from ghostdistill.methods import (
    FLAT_DEFAULTS,
    Method,
    Ordered,
    RecoveryConfig,
    drop_flat_defaults,
    flat_settings,
    get_method,
    make_collectors,
    method_keys,
    register,
    registered,
    setting_keys,
    unregister,
    validate_recovery,
)

C = 64

# What every fit read before the keys were split per method: one flat config with these defaults.
OLD_DEFAULTS = dict(
    fit="first_weighted", bias=False, scale="none", solver="ridge", ridge=1e-4, variant="rotate", order="sequential"
)
KEYS = {
    "none": [],
    "ghost": ["fit", "bias", "scale", "solver", "ridge", "order"],
    "ghost_symmetric": ["fit", "bias", "scale", "ridge", "order"],
    "linearpatch": ["variant", "order"],
    "replaceme": ["solver", "ridge", "order"],
    "magnitude": ["order"],
    "rotation": ["order"],
    "rotation_through": ["order"],
    "rotation_anchored": ["order"],
}
# A valid value for every key, different from its default where the key has choices.
VALUES = dict(fit="plain", bias=True, scale="norm", solver="lstsq", ridge=1e-3, variant="diag", order="independent")


def shipped_entries() -> list[tuple[str, list[dict]]]:
    out = []
    for path in SHIPPED:
        entries = ((yaml.safe_load(path.read_text()) or {}).get("model") or {}).get("recovery")
        if entries:
            out.append((path.name, entries))
    return out


# The fit configs; the compare and frontier files name a base config (`base:`) instead of recovery entries.
FIT_CONFIGS = [p for p in SHIPPED if p.name in dict(shipped_entries())]


def test_every_shipped_file_is_a_fit_config_with_recovery_entries_or_names_a_base():
    others = [p for p in SHIPPED if p not in FIT_CONFIGS]
    assert FIT_CONFIGS and all("base" in yaml.safe_load(p.read_text()) for p in others), [p.name for p in others]


def test_every_method_declares_its_keys():
    assert FLAT_DEFAULTS == OLD_DEFAULTS
    assert set(KEYS) <= set(registered())
    for name, keys in KEYS.items():
        declared = method_keys(get_method(name))
        assert list(declared) == keys, name
        assert {k: declared[k] for k in keys} == {k: OLD_DEFAULTS[k] for k in keys}, name


@pytest.mark.parametrize("method, key", [(m, k) for m, keys in KEYS.items() for k in setting_keys() if k not in keys])
def test_a_key_the_method_does_not_read_is_rejected_naming_the_method_keys(method, key):
    cfg = RecoveryConfig(name="x", method=method, **{key: VALUES[key]})
    with pytest.raises(ValueError) as err:
        validate_recovery([RecoveryConfig(name="ok"), cfg])
    message = str(err.value)
    assert f"recovery[1] 'x' ({method}): key '{key}' is not read by method '{method}'" in message
    if KEYS[method]:
        assert message.endswith(f"its keys are: {', '.join(KEYS[method])}")
    else:
        assert message.endswith("it reads no key but name and method")


def test_the_old_default_of_an_unread_key_is_rejected_too():
    """`variant: rotate` on ghost was always ignored; set, it is an error like any unread key."""
    with pytest.raises(ValueError, match="key 'variant' is not read by method 'ghost'; its keys are: fit, bias"):
        validate_recovery([RecoveryConfig(name="g", variant="rotate")])
    with pytest.raises(
        ValueError, match="key 'ridge' is not read by method 'linearpatch'; its keys are: variant, order"
    ):
        validate_recovery([RecoveryConfig(name="lp", method="linearpatch", ridge=1e-4)])


@pytest.mark.parametrize("method, key", [(m, k) for m, keys in KEYS.items() for k in keys])
def test_every_key_a_method_reads_is_accepted_and_kept(method, key):
    cfg = RecoveryConfig(name="x", method=method, **{key: VALUES[key]})
    validate_recovery([cfg])
    assert getattr(cfg, key) == VALUES[key]
    assert cfg.settings()[key] == VALUES[key]


@pytest.mark.parametrize("method", list(KEYS))
def test_unset_keys_resolve_to_the_old_defaults_and_unread_ones_stay_unset(method):
    cfg = RecoveryConfig(name="x", method=method)
    validate_recovery([cfg])
    assert cfg.settings() == {"name": "x", "method": method, **{k: OLD_DEFAULTS[k] for k in KEYS[method]}}
    for key in setting_keys():
        assert getattr(cfg, key) == (OLD_DEFAULTS[key] if key in KEYS[method] else None), key
    assert cfg.as_dict() == cfg.resolved().as_dict() == cfg.settings()  # unset keys read as their defaults
    assert RecoveryConfig().fit == "first_weighted" and RecoveryConfig().variant is None


def test_an_entry_whose_method_changed_reads_the_new_methods_keys():
    """Keys are read through the method's config class, not stored per entry: nothing to resolve again."""
    cfg = RecoveryConfig(name="x", method="magnitude")
    assert cfg.variant is None
    cfg.method = "linearpatch"
    assert cfg.variant == "rotate" and cfg.resolved().options == {"variant": "rotate", "order": "sequential"}
    assert cfg.settings() == {"name": "x", "method": "linearpatch", "variant": "rotate", "order": "sequential"}


@pytest.mark.parametrize(
    "cfg, match",
    [
        (
            RecoveryConfig(name="x", method="linearpatch", variant="full"),
            r"variant 'full' is not known.*'rotate', 'diag'",
        ),
        (RecoveryConfig(name="x", scale="energy"), r"scale 'energy' is not known.*'none', 'norm'"),
        (RecoveryConfig(name="x", method="replaceme", solver="qr"), r"solver 'qr' is not known.*ridge.*lstsq"),
        (RecoveryConfig(name="x", method="magnitude", order="random"), r"order 'random' is not known.*sequential"),
        (RecoveryConfig(name="x", ridge=-1.0), r"ridge must be a number >= 0, got -1.0"),
        (RecoveryConfig(name="x", method="ghost_symmetric", bias="yes"), r"bias must be true or false, got 'yes'"),
        (RecoveryConfig(name="x", method="lora", variant="diag"), r"method 'lora' is not known.*ghost"),
    ],
)
def test_bad_values_of_read_keys_are_named_with_what_is_valid(cfg, match):
    with pytest.raises(ValueError, match=match):
        validate_recovery([cfg])


@pytest.mark.parametrize("name", ["ghost_ft", "linearpatch_ft", "x_ft"])
def test_names_of_fine_tuned_views_are_reserved(name):
    with pytest.raises(ValueError, match=rf"'{name}': names ending in '_ft' are reserved for fine-tuned views"):
        validate_recovery([RecoveryConfig(name="ghost"), RecoveryConfig(name=name)])
    # DistillConfig checks the views it makes against the recovery names on its own, too.
    base = name.removesuffix("_ft")
    with pytest.raises(ValueError, match=rf"would make views \['{name}'\].*reserved for the fine-tuned views"):
        DistillConfig(methods=[base]).validate([base, name])


@pytest.mark.parametrize("name", ["dense", "pruned"])
def test_baseline_names_are_reserved(name):
    with pytest.raises(ValueError, match=rf"'{name}': the name is reserved for the baselines \['dense', 'pruned'\]"):
        validate_recovery([RecoveryConfig(name=name)])


def test_ft_inside_a_name_is_fine():
    validate_recovery([RecoveryConfig(name="ghost_ftw"), RecoveryConfig(name="ft_ghost")])


class _NoKeys(Method):
    """A method that declares no config class of its own: it reads `order` only (every method with
    statistics can be fitted sequentially)."""

    name = "no_keys"


@dataclass
class _RankConfig(Ordered):
    rank: int = 8


@dataclass
class _BadRidge(Ordered):
    ridge: str = "high"


@dataclass(kw_only=True)
class _NoDefault(Ordered):
    depth: int


def test_a_method_without_a_config_reads_order_only_and_a_new_key_joins_the_recovery_entries():
    method = register(_NoKeys())
    try:
        assert RecoveryConfig(name="n", method="no_keys").settings() == {
            "name": "n",
            "method": "no_keys",
            "order": "sequential",
        }
        with pytest.raises(ValueError, match="key 'fit' is not read by method 'no_keys'; its keys are: order"):
            validate_recovery([RecoveryConfig(name="n", method="no_keys", fit="plain")])
    finally:
        unregister(method.name)
    ranked = _NoKeys()
    ranked.name, ranked.config = "ranked", _RankConfig
    register(ranked)
    try:
        assert "rank" in setting_keys() and RecoveryConfig(name="r", method="ranked").rank == 8
        cfg = RecoveryConfig(name="r", method="ranked", rank=4)
        validate_recovery([cfg])
        assert cfg.method_config() == _RankConfig(name="r", rank=4)
        assert RecoveryConfig().rank is None and "rank" not in flat_settings(RecoveryConfig())
        with pytest.raises(ValueError, match="key 'rank' is not read by method 'ghost'"):
            validate_recovery([RecoveryConfig(name="g", rank=4)])
        with pytest.raises(ValueError, match="rank must be a number, got 'four'"):
            validate_recovery([RecoveryConfig(name="r", method="ranked", rank="four")])
    finally:
        unregister("ranked")
    assert "rank" not in setting_keys() and "ranked" not in registered()


def test_bad_config_classes_fail_at_registration_naming_the_method():
    bad = _NoKeys()
    bad.config = _BadRidge
    with pytest.raises(ValueError, match=r"key 'ridge' is <class 'str'> here and <class 'float'> in method 'ghost'"):
        register(bad)
    bad.config = _NoDefault
    with pytest.raises(ValueError, match=r"keys \['depth'\] of _NoDefault need a default"):
        register(bad)
    bad.config = dict
    with pytest.raises(TypeError, match="must be a dataclass subclassing ghostdistill.methods.MethodConfig"):
        register(bad)
    assert "no_keys" not in registered()


def test_a_taken_name_is_refused_naming_both_registrants():
    impostor = _NoKeys()
    impostor.name = "ghost"
    with pytest.raises(
        ValueError, match=r"'ghost' is registered by ghostdistill.methods.ghost.Ghost; test_config._NoKeys"
    ):
        register(impostor)
    assert get_method("ghost").config.__name__ == "GhostConfig"
    register(get_method("ghost"))  # the same object again: nothing changes


@pytest.mark.parametrize("path", FIT_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_passes_validate_recovery(path):
    entries = dict(shipped_entries())[path.name]
    cfgs = [RecoveryConfig(**entry) for entry in entries]
    validate_recovery(cfgs)
    distill = ((yaml.safe_load(path.read_text()).get("model") or {}).get("distill") or {}).get("methods") or []
    DistillConfig(methods=distill).validate([c.name for c in cfgs])
    for entry, cfg in zip(entries, cfgs):
        # Exactly the values the flat config gave: the old defaults under what the entry sets.
        old = {**OLD_DEFAULTS, **{k: v for k, v in entry.items() if k not in ("name", "method")}}
        assert cfg.settings() == {"name": cfg.name, "method": cfg.method, **{k: old[k] for k in KEYS[cfg.method]}}


@pytest.mark.parametrize("path", FIT_CONFIGS, ids=lambda p: p.name)
def test_configs_written_by_the_flat_version_still_load_and_digest_as_before(path):
    """A run folder's config.yaml from before the split lists every key of every entry (the flat defaults
    where unset): `drop_flat_defaults` makes it validate to the same settings, and `flat_settings` gives
    the dict (and so the digest of saved scores) `asdict` gave then."""
    entries = dict(shipped_entries())[path.name]
    for entry in entries:
        written = {"method": "ghost", **FLAT_DEFAULTS, **entry}  # what the flat version wrote for it
        cfg = RecoveryConfig(**entry)
        if KEYS[cfg.method] != list(setting_keys()):
            with pytest.raises(ValueError, match="is not read by method"):
                validate_recovery([RecoveryConfig(**written)])
        loaded = RecoveryConfig(**drop_flat_defaults(written))
        validate_recovery([loaded])
        assert loaded.settings() == cfg.settings()
        assert flat_settings(cfg) == written and json_digest(flat_settings(cfg)) == json_digest(written)


def test_drop_flat_defaults_keeps_values_that_never_applied():
    entry = {"name": "g", "method": "ghost", "variant": "diag", "ridge": 1e-4}
    assert drop_flat_defaults(entry) == entry
    with pytest.raises(ValueError, match="key 'variant' is not read by method 'ghost'"):
        validate_recovery([RecoveryConfig(**drop_flat_defaults(entry))])
    assert drop_flat_defaults({"name": "n", "method": "none", "order": "sequential", "ridge": 1e-4}) == {
        "name": "n",
        "method": "none",
    }


def _operators(pm: PrunedModel, view: str) -> dict[str, torch.Tensor]:
    out = {}
    for prefix, group in (("operators", pm.operators), ("mlp_maps", pm.mlp_maps)):
        out.update({f"{prefix}.{k}": v.clone() for k, v in group[view].state_dict().items()})
    return out


@torch.no_grad()
def test_operators_are_bit_identical_to_the_flat_config_for_defaults_and_every_shipped_entry():
    """Sequential fits over two gaps, each default and every distinct shipped entry, against the same
    entry with every old default passed explicitly (the object the flat config made: unread keys set)."""
    entries = [{"method": m} for m in KEYS]
    for _, shipped in shipped_entries():
        for entry in shipped:
            settings = {"method": "ghost", **{k: v for k, v in entry.items() if k != "name"}}
            if settings not in entries:
                entries.append(settings)
    new = [RecoveryConfig(name=f"new{i}", **e) for i, e in enumerate(entries)]
    # Bypasses resolution of the unread keys: what every fit saw before (they are fitted, not validated).
    old = [RecoveryConfig(name=f"old{i}", **{**OLD_DEFAULTS, **e}) for i, e in enumerate(entries)]
    validate_recovery(new)
    model = tiny_model("llama", num_layers=6)
    plan = PruningPlan.from_layers([1, 3, 4], 6)
    assert len(plan.gaps) == 2
    batches = random_batches(4)
    methods = {c.method for c in new}
    results = {}
    for label, cfgs in (("new", new), ("old", old)):
        pm = PrunedModel(model, plan)
        stats = {g.key: make_collectors(methods, C, "cpu") for g in plan.gaps}
        accumulate(model, pm.stack, plan.gaps, batches, stats)
        report = fit_methods(cfgs, pm, stats, batches, C, "cpu")
        results[label] = (pm, report)
    (pm_new, rep_new), (pm_old, _) = results["new"], results["old"]
    for i, entry in enumerate(entries):
        a, b = _operators(pm_new, f"new{i}"), _operators(pm_old, f"old{i}")
        assert a.keys() == b.keys(), entry
        for key in a:
            assert torch.equal(a[key], b[key]), (entry, key)
        if entry["method"] != "none":
            assert a, entry
        # The report records the resolved value of every key the method reads, and no other key.
        # (`notes`: what a fit had to say, e.g. rotation_anchored without a massive first position to anchor.)
        row = {k: v for k, v in rep_new[f"new{i}"].items() if k not in ("name", "fit_s", "notes")}
        assert row == {k: getattr(old[i], k) for k in setting_keys() if k in KEYS[entry["method"]]} | {
            "method": entry["method"]
        }, entry
