"""Serve exported folders with vLLM and measure what `scripts/check_serving.py` compares: greedy tokens,
perplexity from prompt log-probabilities, and prefill / decode throughput.

Runs in an environment with vLLM (`bash scripts/setup.sh --serve` makes `.venv-serve`, which holds
ghostdistill and vLLM together; ghostdistill itself is not imported here). Reads one `torch.save`d request:

    {"views": {name: folder}, "prompts": [[token ids], ...], "new": tokens to generate,
     "windows": LongTensor [n, seq_len] (the run's evaluation windows), "dtype": "float32",
     "throughput": {"variants": {name: [view, model_impl]}, "repeats": 5, "prefill": [prompts, tokens],
     "decode": [prompts, prompt tokens, new tokens]} or None, "eager": true,
     "keep_going": [names of views whose failure to load is reported, not raised],
     "skip": [names of views measured by an earlier process, not served again]}

and writes JSON (again after each view, atomically, with `"done": false` until the last): per view the greedy
continuation of every prompt (token ids), the perplexity over the windows (mean next-token NLL over every
position but the last of each window, as `fit` evaluates), the load time; and, with `throughput`, tokens per second of each view in interleaved repeats (a, b, a, b, ...). A view in
`keep_going` (a quantized folder, whose scheme this build of vLLM may not serve) that fails gets its error's
last line instead. vLLM's CPU build has been seen to abort (`terminate called without an active exception`, once
in many CI runs): what was measured before is on disk, `"done": true` once everything is, and
`check_serving.run_vllm` serves once more only the views an aborted process did not reach.

Every prompt is passed as token ids (`TokensPrompt`), so no stack's tokenizer decides what the model sees.
vLLM packs the sequences of a batch into one row; the exported operator decides the first position from the
position ids, which is what the token comparison checks. A folder with operators is loaded through its
`modeling_ghostdistill.py` (`trust_remote_code=True`, vLLM's Transformers backend); a plain folder through
vLLM's own model of its family.

    VLLM_CPU_KVCACHE_SPACE=1 .venv-serve/bin/python scripts/serving/vllm_check.py request.pt out.json
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path


def load(folder: str, dtype: str, max_len: int, eager: bool, impl: str = "auto"):
    """`impl`: vLLM's `model_impl` (``auto``: its own model of the family where it has one, else the
    Transformers backend; ``transformers``: the Transformers backend always)."""
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(
        model=folder,
        dtype=dtype,
        trust_remote_code=os.path.isfile(os.path.join(folder, "modeling_ghostdistill.py")),
        max_model_len=max_len,
        enforce_eager=eager,
        model_impl=impl,
        seed=0,
    )
    return llm, time.perf_counter() - start


def greedy(llm, prompts: list[list[int]], new: int) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def perplexity(llm, windows: list[list[int]]) -> dict:
    """exp(mean NLL) of every token after the first of each window, from vLLM's prompt log-probabilities."""
    from vllm import SamplingParams, TokensPrompt

    # prompt_logprobs=0: each position's log-probability of the token that is there (no top-k beside it).
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], params, use_tqdm=False)
    nll, count = 0.0, 0
    for window, out in zip(windows, outs):
        for token, entry in zip(window[1:], out.prompt_logprobs[1:]):
            nll -= entry[token].logprob
            count += 1
    return {"ppl": math.exp(nll / count), "nll": nll / count, "scored": count}


def throughput(llms: dict, spec: dict) -> dict:
    """Prefill and decode tokens per second of each view, in interleaved repeats (a, b, a, b, ...), so that
    what the machine does meanwhile falls on both alike; the first round warms up and is not counted."""
    from vllm import SamplingParams, TokensPrompt

    n_pre, len_pre = spec["prefill"]
    n_dec, len_dec, new = spec["decode"]
    vocab = 1000  # ids well inside every vocabulary; what they say does not matter for the time
    prefill_prompts = [
        TokensPrompt(prompt_token_ids=[(7 * i + 13 * j) % vocab + 10 for j in range(len_pre)]) for i in range(n_pre)
    ]
    decode_prompts = [
        TokensPrompt(prompt_token_ids=[(11 * i + 3 * j) % vocab + 10 for j in range(len_dec)]) for i in range(n_dec)
    ]
    prefill_params = SamplingParams(temperature=0.0, max_tokens=1)
    decode_params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    times: dict = {v: {"prefill": [], "decode": []} for v in llms}
    for repeat in range(spec["repeats"] + 1):
        for view, llm in llms.items():
            start = time.perf_counter()
            llm.generate(prefill_prompts, prefill_params, use_tqdm=False)
            prefill_s = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate(decode_prompts, decode_params, use_tqdm=False)
            decode_s = time.perf_counter() - start
            if repeat:  # round 0 warms up
                times[view]["prefill"].append(n_pre * len_pre / prefill_s)
                times[view]["decode"].append(n_dec * new / decode_s)
    return {
        view: {
            "prefill_tok_s": statistics.median(t["prefill"]),
            "decode_tok_s": statistics.median(t["decode"]),
            "prefill_all": t["prefill"],
            "decode_all": t["decode"],
        }
        for view, t in times.items()
    } | {"spec": spec}


def position_limit(folder: str) -> int:
    """A folder's `max_position_embeddings` (its text config's in a nested config); 1024 when it has none."""
    config = json.loads((Path(folder) / "config.json").read_text())
    config = config.get("text_config") or config
    return int(config.get("max_position_embeddings") or 1024)


def missing_kernel(folder: str) -> str | None:
    """Why this build of vLLM cannot run `folder`'s weight-only int4 layers, or None.

    vLLM's CPU wheel carries one extension per instruction set and loads the one the CPU has. On a CPU with
    AVX2 only it loads `_C_AVX2`, which has no `cpu_gemm_wna16`, the kernel its W4A16 (WNA16) linear layer
    calls: the engine would load the folder and then die in the first forward with an `EngineDeadError`
    whose cause is only in the worker's log. Asked before loading, the reason is reported per view instead.
    """
    import torch

    config = json.loads((Path(folder) / "config.json").read_text()).get("quantization_config") or {}
    groups = (config.get("config_groups") or {}).values()
    weight_only_int4 = any(
        (g.get("weights") or {}).get("num_bits") == 4 and not g.get("input_activations") for g in groups
    )
    if not weight_only_int4 or torch.cuda.is_available():
        return None
    import vllm._custom_ops  # noqa: F401  (loads the extension of this CPU's instruction set)

    try:
        torch.ops._C.cpu_gemm_wna16  # noqa: B018
    except (AttributeError, RuntimeError):
        flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        isa = "with AVX-512" if "avx512f" in flags else "AVX2 without AVX-512"
        return (
            "this CPU build of vLLM has no cpu_gemm_wna16 kernel for weight-only int4 (W4A16) layers: its "
            f"extension for this CPU ({isa}) lacks it; serve W4A16 on a CPU with AVX-512 or a GPU"
        )
    return None


def main(request_path: str, out_path: str) -> None:
    import torch

    request = torch.load(request_path, weights_only=True)
    windows = request["windows"].tolist() if request.get("windows") is not None else []
    need = max([len(p) + request["new"] for p in request["prompts"]] + [len(w) for w in windows])
    # At least 1024 positions, but never more than a folder's position limit (vLLM refuses a longer
    # max_model_len: a tiny Gemma 3 of 512 positions).
    max_len = max(need, min([1024, *(position_limit(f) for f in request["views"].values())]))
    eager = bool(request.get("eager", True))
    result: dict = {"vllm": __import__("vllm").__version__, "eager": eager, "views": {}}
    dtype = request.get("dtype", "float32")
    keep_going = set(request.get("keep_going") or [])

    def write(done: bool) -> None:
        tmp = f"{out_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(result | {"done": done}, f, indent=2)
        os.replace(tmp, out_path)

    skip = set(request.get("skip") or [])
    for view, folder in request["views"].items():
        if view in skip:
            continue
        try:
            missing = missing_kernel(folder)
            if missing:
                raise RuntimeError(missing)
            llm, load_s = load(folder, dtype, max_len, eager)
            entry = {"load_s": load_s, "tokens": greedy(llm, request["prompts"], request["new"])}
            if windows:
                entry.update(perplexity(llm, windows))
        except Exception as error:  # noqa: BLE001  (reported per view: which schemes this build serves)
            if view not in keep_going:
                raise
            result["views"][view] = {"error": f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}"}
            print(f"vllm {view}: {result['views'][view]['error']}", flush=True)
            write(done=False)
            continue
        result["views"][view] = entry
        print(f"vllm {view}: {json.dumps({k: v for k, v in entry.items() if k != 'tokens'})}", flush=True)
        write(done=False)
        del llm
    spec = request.get("throughput")
    if spec:
        # Each entry {name: [view, model_impl]}: a view through vLLM's own model and through the
        # Transformers backend tells the backend's cost apart from the operator's.
        llms = {
            name: load(request["views"][view], dtype, max_len, eager, impl)[0]
            for name, (view, impl) in spec["variants"].items()
        }
        result["throughput"] = throughput(llms, spec)
    write(done=True)


if __name__ == "__main__":  # vLLM starts worker processes, which import this file again
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main(sys.argv[1], sys.argv[2])
