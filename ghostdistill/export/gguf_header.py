"""A GGUF file's metadata (`header`: what `gguf.write_gguf` writes before the tensors), and what transformers'
own GGUF reader makes of it (`transformers_misreadings`), before any file is written.

**transformers' reader.** `AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)` rebuilds the model's
config from the file's metadata alone (`modeling_gguf_pytorch_utils.load_gguf_checkpoint`): a per-architecture
table (`integrations/ggml.py`, ``GGUF_CONFIG_MAPPING``) maps some llama.cpp keys to config keys, and every other
setting takes the config class's default, which is one checkpoint's value. Where the default is not the view's,
the model read back computes something else. What it misses, read from transformers 5's tables and checked on
the tiny models of every family (tests/export/test_gguf_readers.py):

- Gemma 3: ``gemma3.attention.sliding_window_pattern`` is not in the table, so `Gemma3TextConfig` rebuilds its
  default pattern (every 6th layer full) over the surviving blocks; a pruned model's survivors keep their own
  pattern, so some blocks get the wrong attention type, and with it the other rope base (the sliding layers
  rotate with 10 000, the full ones with 1 000 000). ``query_pre_attn_scalar`` is not in it either (default
  256: right for Gemma 3's 270M … 12B, whose heads are 256 wide).
- Qwen3: ``qwen3.attention.key_length`` is not in its table, so ``head_dim`` is `Qwen3Config`'s 128 (every
  released Qwen3's; a model of other heads does not load).
- Mistral: written as llama.cpp's ``llama`` architecture, it is read as a LLaMA (no sliding window; llama.cpp
  attends to the whole context too, `gguf_arch`).

So the file is compared with the view, not the family with a list: the view's metadata is written to a small
file of its own (the header and one tensor, which says whether the head is tied), transformers' reader builds
its config from it (`AutoConfig.from_pretrained(..., gguf_file=)`: metadata only, no weights, no model), and
every setting the computation depends on (`settings`) is compared with the view's config. Each difference is
one line naming the reader, the setting, both values and the blocks it changes; the export prints it and writes
it into the model card. A newer transformers that reads a key is then simply not warned about.

**vLLM.** Its GGUF loader takes the config from the same reader (`vllm/transformers_utils/config.py`,
`get_config`: ``PretrainedConfig.get_config_dict(folder, gguf_file=name)``) unless ``--hf-config-path`` names a
folder, so the same line holds for it. **llama.cpp** reads every key written (`gguf_arch`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import tempfile
from pathlib import Path

import gguf
import numpy as np

from .gguf_arch import add_hparams, family, rope_of
from .gguf_vocab import add_vocab, copy_vocab

READER = "transformers (gguf_file=)"
# Settings whose difference changes the weights' shapes: the load itself fails.
SHAPES = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")


def header(view, file_type: int) -> gguf.GGUFWriter:
    """A writer holding every metadata key of `view`'s file (`writer.ViewExport`) of llama.cpp file type
    `file_type`: the architecture, the hyper-parameters (`gguf_arch.add_hparams`), the ``ghostdistill.*`` keys
    and the tokenizer (`gguf_vocab`; a tokenizer it does not read takes `view.vocab_source`'s vocabulary)."""
    config, tokenizer, name = view.config, view.tokenizer, view.view
    if tokenizer is None:
        raise ValueError("GGUF export needs the tokenizer: llama.cpp reads the vocabulary from the file")
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[family(config).arch])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    add_hparams(writer, config, file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    info = view.info
    plan = info.get("plan") or {}
    writer.add_string("ghostdistill.view", str(info.get("view", name)))
    if plan.get("num_layers") is not None:
        writer.add_uint32("ghostdistill.dense_block_count", int(plan["num_layers"]))
    if plan.get("removed"):
        writer.add_array("ghostdistill.removed_blocks", [int(i) for i in plan["removed"]])
    writer.add_string("ghostdistill.provenance", json.dumps(info, default=str, sort_keys=True))
    try:
        add_vocab(writer, tokenizer, config.vocab_size)
    except ValueError:
        if view.vocab_source is None:
            raise
        copy_vocab(writer, view.vocab_source, config.vocab_size)
    return writer


def transformers_config(view):
    """The config transformers' GGUF reader builds from `view`'s file (module docstring), or None where it
    does not read the architecture."""
    from transformers import AutoConfig

    writer = header(view, gguf.LlamaFileType.ALL_F32)
    # The only tensor the config depends on: a file without `output.weight` is read as a tied head.
    tensor = "token_embd.weight" if getattr(view.config, "tie_word_embeddings", False) else "output.weight"
    writer.add_tensor(tensor, np.zeros(1, np.float32))
    quiet = logging.getLogger("transformers")
    with tempfile.TemporaryDirectory(prefix="ghostdistill-gguf-") as tmp, contextlib.ExitStack() as stack:
        stack.callback(quiet.setLevel, quiet.level)
        quiet.setLevel(logging.ERROR)  # its "keys not parsed" notes are what this module reports, in one line
        path = Path(tmp) / f"{view.view}.gguf"
        writer.write_header_to_file(path=path)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        try:
            return AutoConfig.from_pretrained(tmp, gguf_file=path.name)
        except ValueError as err:  # "GGUF model with architecture ... is not supported yet"
            if "not supported" in str(err):
                return None
            raise


def layer_types(config) -> list[str]:
    """Each block's attention: ``sliding_attention`` where a window applies, else ``full_attention``."""
    n = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or [])
    if not getattr(config, "sliding_window", None):
        return ["full_attention"] * n
    if len(types) != n:  # no per-layer list (Mistral): a window is every layer's
        return ["sliding_attention"] * n
    return ["sliding_attention" if t == "sliding_attention" else "full_attention" for t in types]


def settings(config) -> dict:
    """What the computation of a decoder of `config` depends on, in comparable form."""
    types = layer_types(config)
    return {key: getattr(config, key, None) for key in SHAPES} | dict(
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        vocab_size=config.vocab_size,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        rms_norm_eps=getattr(config, "rms_norm_eps", None),
        activation=getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None),
        attention_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        layer_types=types,
        sliding_window=getattr(config, "sliding_window", None) if "sliding_attention" in types else None,
        rope=[rope_of(config, t) for t in types],
        query_pre_attn_scalar=getattr(config, "query_pre_attn_scalar", None),
        final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
        attn_logit_softcapping=getattr(config, "attn_logit_softcapping", None),
    )


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):  # a GGUF file holds float32 (rms_norm_eps 1e-6)
        return math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _full(types: list[str]) -> list[int]:
    return [i for i, t in enumerate(types) if t == "full_attention"]


def differences(view_config, read_config) -> tuple[list[str], bool]:
    """(what transformers' config `read_config` states other than the view's, each as "with <what it reads>,
    not this file's <what the file says>" naming the blocks it changes; whether llama.cpp reads those right)."""
    mine, theirs = settings(view_config), settings(read_config)
    out, llama_cpp = [], True
    wrong = [i for i, (a, b) in enumerate(zip(mine["layer_types"], theirs["layer_types"])) if a != b]
    if wrong and "sliding_attention" not in theirs["layer_types"] and "full_attention" not in mine["layer_types"]:
        # No pattern in the file (the LLaMA and Qwen families): llama.cpp attends to the whole context too.
        window, llama_cpp = mine["sliding_window"], False
        out.append(
            f"without the sliding window of {window} tokens (full attention in every block, as llama.cpp does "
            f"too): the same model up to {window} tokens"
        )
    elif wrong:
        rope = any(not _same(mine["rope"][i], theirs["rope"][i]) for i in wrong)
        out.append(
            f"with the default sliding pattern (full attention at blocks {_full(theirs['layer_types'])}), not this "
            f"file's per-block pattern (full attention at blocks {_full(mine['layer_types'])}): its blocks {wrong} "
            f"get the wrong attention type{' and rope base' if rope else ''}"
        )
    for key, value in mine.items():
        if key in ("layer_types", "rope", "sliding_window") or _same(value, theirs[key]):
            continue
        fails = " (the weights then do not fit: the load fails)" if key in SHAPES + ("head_dim",) else ""
        out.append(f"with {key} {theirs[key]}, not this file's {value}{fails}")
    if not wrong and not _same(mine["sliding_window"], theirs["sliding_window"]):
        out.append(f"with a sliding window of {theirs['sliding_window']}, not this file's {mine['sliding_window']}")
    rope = [i for i, (a, b) in enumerate(zip(mine["rope"], theirs["rope"])) if i not in wrong and not _same(a, b)]
    if rope:
        theirs_rope, mine_rope = theirs["rope"][rope[0]], mine["rope"][rope[0]]
        out.append(f"with the rope (type, base, factor) {theirs_rope} at blocks {rope}, not this file's {mine_rope}")
    return out, llama_cpp


def transformers_misreadings(view, files: list[str]) -> list[str]:
    """One line per GGUF view whose file(s) `files` transformers' `gguf_file=` reader would read as another
    model (module docstring); empty where it reads them as the view, or does not read the architecture."""
    read = transformers_config(view)
    if read is None:
        return []
    found, llama_cpp = differences(view.config, read)
    if not found:
        return []
    right = "; llama.cpp reads it right" if llama_cpp else ""
    return [
        f"{READER} reads {', '.join(files)} {'; and '.join(found)}{right}; for transformers, and vLLM (whose GGUF "
        "loader uses the same reader), use the exported folder"
    ]
