"""Per family, what llama.cpp's `convert_hf_to_gguf.py` writes into a GGUF file: the architecture, how the
tensors change on the way, and the hyper-parameters (read from the vendored converter's `conversion/llama.py`,
`qwen.py`, `gemma.py` and `TextModel.set_gguf_parameters` in `base.py`, and from what llama.cpp's loader reads
in `src/models/<arch>.cpp`).

| `model_type` | architecture | Q/K rows | norms | keys beyond the common ones |
|---|---|---|---|---|
| llama, mistral | ``llama`` (the converter's `LlamaModel` takes `MistralForCausalLM` too) | permuted | as they are | vocab size, rope dimension count |
| qwen2 | ``qwen2`` (q/k/v biases, `blk.<i>.attn_q.bias` …) | as they are | as they are | – |
| qwen3 | ``qwen3`` (per-head q/k norms, `blk.<i>.attn_q_norm.weight` …) | as they are | as they are | – |
| gemma3_text | ``gemma3`` (post-attention and post-MLP norms) | as they are | γ + 1 | sliding window, its per-layer pattern, the sliding layers' rope base, final logit soft-cap |

- **Q/K permutation** (LLaMA only): llama.cpp's ``llama`` graph rotates interleaved pairs (x₀, x_{d/2}, x₁, …),
  Hugging Face's rotary code the two halves of each head: for W of shape [h·d, C] viewed as [h, 2, d/2, C],
  swap the two middle axes (`LlamaModel.permute`; K with the key-value head count). q·k is unchanged, both
  sides getting the same permutation of each head's rotary pairs. Qwen and Gemma run NeoX-style rotary in
  llama.cpp, the halves as Hugging Face has them: nothing to permute.
- **Gemma's norm offset.** `Gemma3RMSNorm` computes x/rms(x)·(1 + γ) and llama.cpp's RMS norm x/rms(x)·γ', so
  every ``*norm.weight`` is written as γ' = γ + 1 (`Gemma3Model.norm_shift`), the q/k norms included. The
  embedding scale √C is not a tensor: llama.cpp's gemma3 graph multiplies by √n_embd itself, as
  `Gemma3TextScaledWordEmbedding` does.
- **Gemma's sliding window, per layer** (llama.cpp issue #27976). The converter writes
  ``gemma3.attention.sliding_window`` and leaves the layer pattern to llama.cpp's default (every 6th layer full,
  `load_swa_pattern(ml, 6)`), which is the dense model's pattern, not a pruned one's: with blocks removed the
  survivors' pattern shifts. ``gemma3.attention.sliding_window_pattern`` as an array of one bool per surviving
  block (true: sliding, from the config's `layer_types`, which `core.views` shrinks with the stack) is what the
  loader reads first, so the file states the survivors' pattern and no array keeps the dense length.
- **Gemma's attention scale.** llama.cpp scales queries by 1/√head_dim, or by 1/√(n_embd/n_head) when the
  model has 62 blocks (its test for Gemma 3 27B); Hugging Face by `query_pre_attn_scalar`^-½. A view where the
  two differ (a pruned 27B, whose block count no longer says 27B) is refused with the reason, since llama.cpp
  would silently compute another model.
- **Sliding windows elsewhere.** For the LLaMA and Qwen families the converter writes no window (Mistral 7B
  v0.1's 4096 included) and llama.cpp attends to the whole context; the files follow it, so such a model
  agrees with Hugging Face up to `sliding_window` tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace

import gguf
import numpy as np
import torch


@dataclass(frozen=True)
class Family:
    arch: gguf.MODEL_ARCH
    permute_qk: bool = False  # `LlamaModel.undo_permute`
    norm_offset: float = 0.0  # added to every ``*norm.weight`` (Gemma's 1 + γ)
    llama_keys: bool = False  # `LlamaModel.set_gguf_parameters`: vocab size, rope dimension count


FAMILIES = {
    "llama": Family(gguf.MODEL_ARCH.LLAMA, permute_qk=True, llama_keys=True),
    "mistral": Family(gguf.MODEL_ARCH.LLAMA, permute_qk=True, llama_keys=True),
    "qwen2": Family(gguf.MODEL_ARCH.QWEN2),
    "qwen3": Family(gguf.MODEL_ARCH.QWEN3),
    "gemma3_text": Family(gguf.MODEL_ARCH.GEMMA3, norm_offset=1.0),
}


def family(config) -> Family:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"GGUF export writes {sorted(FAMILIES)} models; this view is {model_type!r}: convert its Hugging "
            "Face folder with llama.cpp's convert_hf_to_gguf.py"
        )
    return FAMILIES[model_type]


def permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Hugging Face's rotary layout to GGML's, per head (`LlamaModel.permute` of the converter)."""
    head = weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
    return head.swapaxes(1, 2).reshape(weight.shape)


@dataclass
class TensorStream:
    """Tensors known by GGUF name and shape before any is made (`shapes`, in file order); `arrays()` makes them,
    float32, in that order: a view's file is written holding one piece (a block) at a time (`export.pieces`)."""

    shapes: dict[str, tuple[int, ...]]
    arrays: Callable[[], Iterator[tuple[str, np.ndarray]]]


def gguf_tensors(pieces, config) -> TensorStream:
    """The view's tensors under their GGUF names, float32, changed as the module docstring says, a piece at a
    time. `pieces`: `export.pieces.Piece`s (names, shapes, `load()`), or a state dict (one piece)."""
    if isinstance(pieces, Mapping):
        state = pieces
        pieces = [SimpleNamespace(names={n: tuple(t.shape) for n, t in state.items()}, load=lambda: state)]
    fam = family(config)
    n_blocks = config.num_hidden_layers
    names = gguf.get_tensor_name_map(fam.arch, n_blocks)
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    tied = bool(getattr(config, "tie_word_embeddings", False))
    renamed: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for piece in pieces:
        for name, shape in piece.names.items():
            if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                continue
            new = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if new is None:
                raise ValueError(f"tensor {name!r} has no GGUF name for {config.model_type}: it cannot be written")
            renamed[name], shapes[new] = new, tuple(shape)
    blocks = {int(n.split(".")[1]) for n in shapes if n.startswith("blk.")}
    if blocks != set(range(n_blocks)):
        raise ValueError(f"the state has blocks {sorted(blocks)} but the config says {n_blocks}")

    def convert(name: str, tensor: torch.Tensor) -> np.ndarray:
        data = tensor.detach().to("cpu", torch.float32)
        if fam.permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute(data, n_head)
        elif fam.permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute(data, n_kv)
        if fam.norm_offset and name.endswith("norm.weight"):
            data = data + fam.norm_offset
        return data.contiguous().numpy()

    def arrays() -> Iterator[tuple[str, np.ndarray]]:
        for piece in pieces:
            if not set(piece.names) & set(renamed):
                continue
            for name, tensor in piece.load().items():
                if name in renamed:
                    yield renamed[name], convert(name, tensor)

    return TensorStream(shapes, arrays)


def rope_of(config, layer_type: str = "full_attention") -> tuple:
    """(rope type, base, factor) of a block of `layer_type`: per type (Gemma 3) or one for all."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params = dict(params.get(layer_type, params))
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    return params.get("rope_type", params.get("type")) or "default", theta, params.get("factor")


def add_hparams(writer: gguf.GGUFWriter, config, file_type: int) -> None:
    """The hyper-parameters the converter writes for the family (module docstring), with the pruned block count,
    and the file type (`general.file_type`)."""
    fam = family(config)
    hidden, n_head = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // n_head
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or n_head)
    kind, theta, factor = rope_of(config)
    if kind not in ("default", "linear"):
        raise ValueError(
            f"rope_type {kind!r} is not written by ghostdistill's GGUF writer (valid: default, linear): convert "
            "the Hugging Face folder with llama.cpp's convert_hf_to_gguf.py"
        )
    if theta is not None:
        writer.add_rope_freq_base(float(theta))
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(factor))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(file_type)
    if fam.llama_keys:
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if fam.arch == gguf.MODEL_ARCH.GEMMA3:
        # llama.cpp: 1/√(n_embd/n_head) for 62 blocks (Gemma 3 27B), else 1/√head_dim (src/models/gemma3.cpp).
        scalar = getattr(config, "query_pre_attn_scalar", head_dim)
        llama_cpp = hidden / n_head if config.num_hidden_layers == 62 else head_dim
        if abs(float(scalar) - float(llama_cpp)) > 1e-6:
            raise ValueError(
                f"query_pre_attn_scalar {scalar} is not the {llama_cpp:g} llama.cpp's gemma3 graph scales by for "
                f"{config.num_hidden_layers} blocks: its file would compute another model; serve the Hugging Face "
                "folder with vLLM"
            )
        if getattr(config, "attn_logit_softcapping", None):
            raise ValueError("attn_logit_softcapping is not in llama.cpp's gemma3 graph: serve the folder with vLLM")
        if getattr(config, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
        types = list(getattr(config, "layer_types", None) or [])
        if getattr(config, "sliding_window", None) and "sliding_attention" in types:
            if len(types) != config.num_hidden_layers:
                raise ValueError(f"layer_types has {len(types)} entries for {config.num_hidden_layers} blocks")
            writer.add_sliding_window(int(config.sliding_window))
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])  # one bool per block
            local = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention") or {}
            if local.get("rope_theta") is not None:
                writer.add_rope_freq_base_swa(float(local["rope_theta"]))
