"""Load an exported folder as a user would, where ghostdistill cannot be imported, and measure it.

Reads `inputs.pt` ({"ids", "mask"}: prompts, left-padded; "prompts": a list of unpadded prompts (token id
lists), each continued alone; {"windows", "batch_size"}: evaluation windows; "new": tokens to generate),
loads the folder with `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` and writes
`out.pt`: the greedy continuation of the prompts (`generate`, KV cache; batched for "ids", under "tokens";
one by one for "prompts", under "prompt_tokens") and the perplexity over the windows (mean next-token NLL
over every position but the last of each window, as `fit` evaluates). Run as its own process:

    python scripts/reload_check.py <folder> inputs.pt out.pt
"""

from __future__ import annotations

import math
import sys

sys.modules["ghostdistill"] = None  # type: ignore[assignment]  # a fresh process without ghostdistill

import torch  # noqa: E402  (after ghostdistill is made unimportable)
from transformers import AutoModelForCausalLM  # noqa: E402


@torch.no_grad()
def main(folder: str, inputs: str, out: str) -> None:
    x = torch.load(inputs)
    model = AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, dtype=x.get("dtype", torch.float32)
    ).eval()
    result: dict = {"class": f"{type(model).__module__}.{type(model).__name__}"}
    if "ids" in x:
        result["tokens"] = model.generate(
            input_ids=x["ids"],
            attention_mask=x["mask"],
            max_new_tokens=x["new"],
            do_sample=False,
        )
    if "prompts" in x:
        # eos_token_id=None: every prompt gets `new` tokens, an end-of-text one included, as vLLM's
        # ignore_eos and llama.cpp's fixed-length decoding give them.
        result["prompt_tokens"] = [
            model.generate(input_ids=torch.tensor([p]), max_new_tokens=x["new"], do_sample=False, eos_token_id=None)[
                0, len(p) :
            ].tolist()
            for p in x["prompts"]
        ]
    if "windows" in x:
        nll, count = 0.0, 0
        for chunk in x["windows"].split(x["batch_size"]):
            logits = model(input_ids=chunk, use_cache=False).logits[:, :-1].float()
            nll += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"
            ).item()
            count += chunk[:, 1:].numel()
        result.update(ppl=math.exp(nll / count), tokens_scored=count)
    torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
