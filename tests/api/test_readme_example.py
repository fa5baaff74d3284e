"""The README's Python API example, run as a user runs it: its code block, unchanged (`readme_example`), in a
fresh Python process: load the demo's model, repair, generate, save, reload with plain `from_pretrained`.

Its outputs equal `fit` plus `export` of the same settings (`fit_arguments`: the demo's config with the
example's depth, method and calibration size, read from the block): the saved tensors, tensor for tensor; the
same modelling file and config (but for what only `fit`'s evaluation records); and both folders, reloaded in
a process where ghostdistill cannot be imported (`scripts/reload_check.py`), generate the same greedy tokens,
which are what the example printed, and give the same perplexity (the same logits).

Cost on 2 CPU cores: the example (load, 16 × 256 tokens of data-free calibration text generated, one
calibration pass, save) and `fit` of the same settings (one evaluation window), then two short reloads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import WIKITEXT_HEAD
from readme_example import ROOT, call_arguments, fit_arguments, prompt_text, readme_example, saved_folder


def run(command: list[str], cwd, env) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    assert done.returncode == 0, f"{command[:4]} failed:\n{done.stderr[-4000:]}"
    return done


@pytest.mark.slow
def test_the_readme_example_runs_and_equals_fit_plus_export(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    code = readme_example()
    user = tmp_path / "user"
    user.mkdir()
    # The checkout's package, as from the clone's root; the example's folder lands in `user`, not in the clone.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
    }
    example = run([sys.executable, "-c", code], user, env)
    run([sys.executable, "-m", "ghostdistill", *fit_arguments(code, tmp_path / "run")], ROOT, env)
    method = call_arguments(code, "repair")[1]["method"]
    ours, theirs = user / saved_folder(code), tmp_path / "run" / "export" / method

    # The saved tensors are export's, tensor for tensor.
    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert sorted(a) == sorted(b)
    different = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not different, different
    assert (ours / "modeling_ghostdistill.py").read_bytes() == (theirs / "modeling_ghostdistill.py").read_bytes()

    # The config is export's, but for what only fit's evaluation and seed record.
    mine, fits = (json.loads((f / "config.json").read_text()) for f in (ours, theirs))
    only_fit = ("metrics", "reference_metrics", "evaluation", "seed")
    ghost_a, ghost_b = mine.pop("ghostdistill"), fits.pop("ghostdistill")
    for info in (ghost_a, ghost_b):
        for key in only_fit:
            info.pop(key, None)
        info["calibration"].pop("fingerprint")  # keyed by the settings fit also records (its trainer's)
        info["recovery"].pop("fit_s", None)  # the fit's seconds: a timing, not the model
    assert mine == fits
    assert ghost_a == ghost_b

    # Both folders, reloaded where ghostdistill cannot be imported, generate and score alike.
    tok, prompt = AutoTokenizer.from_pretrained(ours, trust_remote_code=True), prompt_text(code)
    windows = torch.tensor(tok(WIKITEXT_HEAD.read_text()[:20_000]).input_ids[: 2 * 256]).view(2, 256)
    inputs = tmp_path / "inputs.pt"
    torch.save({"prompts": [tok(prompt).input_ids], "new": 16, "windows": windows, "batch_size": 2}, inputs)
    bare = {**env, "PYTHONPATH": ""}
    outs = []
    for folder in (ours, theirs):
        out = tmp_path / f"{folder.name}-{len(outs)}.pt"
        run(
            [sys.executable, str(ROOT / "scripts" / "reload_check.py"), str(folder), str(inputs), str(out)],
            tmp_path,
            bare,
        )
        outs.append(torch.load(out))
    assert outs[0]["class"].endswith("GhostPrunedForCausalLM")
    assert outs[0]["prompt_tokens"] == outs[1]["prompt_tokens"]
    assert outs[0]["ppl"] == outs[1]["ppl"]
    # What the example printed: the prompt and its greedy continuation, up to the first end-of-text token.
    eos = json.loads((theirs / "generation_config.json").read_text()).get("eos_token_id")
    eos = set(eos if isinstance(eos, list) else [eos])
    tokens = outs[1]["prompt_tokens"][0]
    cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    assert tok.decode(tok(prompt).input_ids + tokens[:cut]) in example.stdout, example.stdout[-2000:]
