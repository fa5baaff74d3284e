"""llm-compressor's `oneshot` on one exported folder: the script `export.compressed` runs in the environment
that holds llm-compressor (`bash scripts/setup.sh --quantize` makes `.venv-quantize`).

Self-contained (torch, transformers, datasets and llm-compressor; never ghostdistill), because llm-compressor
cannot share an environment with ghostdistill and vLLM: the pins that rule it out are in `export.compressed`'s
docstring (and docs/export.md, "Quantized for vLLM").

    python compressed_oneshot.py <folder> <calibration_ids.pt> <scheme> <out> [<group size>]

- `folder`: a Hugging Face folder written by `ghostdistill export` (plain, or with operators and its
  `modeling_ghostdistill.py`, loaded with `trust_remote_code`);
- `calibration_ids.pt`: a LongTensor [n, seq_len], the run's calibration windows (the tokens the repair was
  fitted on), given to `oneshot` as a tokenized dataset (no text, no tokenizer decides anything), in order;
- `scheme`: one of the recipes below; `group size`: the weight group of the grouped schemes (default: 128,
  llm-compressor's preset, halved until it divides the input width of every quantized linear, because vLLM
  reads ⌊width / group⌋ groups per row: SmolLM2's 576 gets 64);
- `out`: the compressed-tensors folder (`save_compressed`), with the folder's tokenizer.

Recipes, as llm-compressor's examples write them for vLLM:

- ``W8A8``: SmoothQuant (α = 0.8: activation outliers moved into the weights, through each norm into the
  linears it feeds) then GPTQ, int8 weights per output channel and int8 activations per token (dynamic);
- ``W4A16``: GPTQ, int4 weights in groups along the input, symmetric; activations stay in the model's dtype;
- ``W4A16-AWQ``: AWQ (activation-aware scales, searched per norm → linears mapping) then int4 asymmetric
  weights in groups;
- ``W8A16``: GPTQ, int8 weights in groups.

The output head is left in the model's dtype (ignored by its full name, `lm_head` or `pruned.lm_head`), as in
every llm-compressor example: it is tied to the embedding in most small models. The gap operators of an operator folder are parameters, not
linears, so they stay in float32 too.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def recipe(scheme: str, group_size: int, ignore: list[str]):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    def weights(bits: int, symmetric: bool) -> dict:
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=group_size)
        return {"group_0": QuantizationScheme(targets=["Linear"], weights=args)}

    if scheme == "W8A8":
        return [
            SmoothQuantModifier(smoothing_strength=0.8),
            GPTQModifier(targets="Linear", scheme="W8A8", ignore=ignore),
        ]
    if scheme in ("W4A16", "W8A16"):  # W<bits>A16
        return [GPTQModifier(config_groups=weights(int(scheme[1]), True), ignore=ignore)]
    if scheme == "W4A16-AWQ":
        # 0.14's API: AWQ only rescales (a transform); the quantizing modifier after it rounds the weights.
        return [AWQModifier(), QuantizationModifier(config_groups=weights(4, False), ignore=ignore)]
    raise SystemExit(f"scheme {scheme!r} is not one of W8A8, W4A16, W4A16-AWQ, W8A16")


def heads(model) -> list[str]:
    """The output head's full name: compressed-tensors matches `ignore` names exactly, and an operator folder
    holds the family's causal LM under ``pruned.`` (``pruned.lm_head``)."""
    return [name for name, _ in model.named_modules() if name.split(".")[-1] == "lm_head"]


def largest_group(model, start: int = 128) -> int:
    """`start` halved until it divides the input width of every linear but the head (at least 8)."""
    widths = {
        m.in_features for name, m in model.named_modules() if type(m).__name__ == "Linear" and "lm_head" not in name
    }
    group = start
    while group > 8 and any(w % group for w in widths):
        group //= 2
    return group


def main(folder: str, ids_path: str, scheme: str, out: str, group_size: int = 0) -> None:
    import llmcompressor
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(folder)
    remote = (source / "modeling_ghostdistill.py").is_file()
    ids = torch.load(ids_path, weights_only=True)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(source, dtype="auto", trust_remote_code=remote)
    tokenizer = AutoTokenizer.from_pretrained(source)
    group_size = group_size or largest_group(model)
    oneshot(
        model=model,
        tokenizer=tokenizer,
        trust_remote_code_model=remote,  # oneshot re-reads the folder's config itself
        dataset=data,
        recipe=recipe(scheme, group_size, heads(model)),
        num_calibration_samples=ids.shape[0],
        max_seq_length=ids.shape[1],
        shuffle_calibration_samples=False,
        output_dir=out,
    )
    target = Path(out)
    if remote and not (target / "modeling_ghostdistill.py").is_file():
        shutil.copyfile(source / "modeling_ghostdistill.py", target / "modeling_ghostdistill.py")
    versions = {"llmcompressor": llmcompressor.__version__, "transformers": __import__("transformers").__version__}
    (target / "oneshot.json").write_text(
        json.dumps({"scheme": scheme, "group_size": None if scheme == "W8A8" else group_size, **versions}) + "\n"
    )


if __name__ == "__main__":
    main(*sys.argv[1:5], *(int(a) for a in sys.argv[5:6]))
