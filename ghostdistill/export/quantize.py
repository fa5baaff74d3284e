"""GGUF k-quants (Q6_K, Q5_K_M, Q4_K_M, …) from llama.cpp's own `llama-quantize`, with an importance matrix from
`llama-imatrix` over the run's calibration windows. No k-quant is written here: ghostdistill writes the view's
F32 file (`export.gguf`) and llama.cpp's tools do the rest, as they would for any converted model.

**Which types.** `QUANTIZE_TYPES`: those of llama-quantize's own list (`QUANT_OPTIONS` in
`tools/quantize/quantize.cpp`) that it describes with a size and a perplexity change measured on Llama-3-8B: the
32-value types Q4_0 … Q5_1 and the k-quant mixes Q2_K … Q6_K. Its i-quants (IQ1_S … IQ4_XS), ternary,
MXFP4 and 1-2 bit types are left out. F32, F16 and Q8_0 stay ghostdistill's own (`export.gguf.GGUF_TYPES`). A
k-quant packs 256 values a block: a row whose length is not a multiple of 256 (SmolLM2's 576-wide hidden size)
takes llama-quantize's own fallback (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, 32-value blocks), which its log
names per tensor.

**The importance matrix** weights each input column of a matrix by the mean square of the activations that
multiply it, so the quantizer spends its error where the activations are small. It comes from the run's own
calibration windows (what the repair was fitted on): llama-imatrix reads one text file, tokenizes it as a whole
and cuts it into chunks of `-c` tokens. So the windows are decoded and written one after another, with
`-c` = the window length, and each chunk is one window: the decoded text of a window must tokenize back to the
window (a window cut inside a multi-byte character does not), and two windows joined must not merge across the
join (a window ending in ``hel`` before one starting ``lo``); windows are ordered so that no join merges, and
those that cannot be placed are left out and counted. `llama-tokenize` on the written file then checks that
llama.cpp's tokens are exactly the windows. With a tokenizer that adds BOS, llama-imatrix puts BOS at the start
of every chunk (over the window's first token), as llama.cpp's perplexity does; the text then starts at the
first window's second token, so that the chunks still fall on the windows.
Without the importance matrix (`imatrix=False`, `--no-imatrix`), llama-quantize rounds to nearest per block;
Q2_K_S needs one (llama-quantize refuses it otherwise), so it is refused before any work.

**Where the tools are.** `$GHOSTDISTILL_LLAMA_CPP`, else the checkout's `.serve/llama.cpp`: the build of
`scripts/serving/llama_cpp.sh`, with `bin/llama-quantize`, `bin/llama-imatrix`, `bin/llama-tokenize` (the last two
for the importance matrix only: `--no-imatrix` needs llama-quantize alone). Where those asked for are not built,
asking for a k-quant is refused before anything loads, naming the command that builds them.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from ..core.io import atomic_path
from .gguf_vocab import adds

QUANTIZE_TYPES = tuple("Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q2_K_S Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K".split())
NEEDS_IMATRIX = ("Q2_K_S",)
TOOLS = ("llama-quantize", "llama-imatrix", "llama-tokenize")
ENV = "GHOSTDISTILL_LLAMA_CPP"
BUILD = "bash scripts/serving/llama_cpp.sh"
CHECKOUT = Path(__file__).resolve().parents[2]


def quantized(types: Iterable[str]) -> list[str]:
    return [t for t in types if t in QUANTIZE_TYPES]


def llama_cpp_root() -> Path:
    """Where llama.cpp's build is: `$GHOSTDISTILL_LLAMA_CPP`, else the checkout's `.serve/llama.cpp`."""
    return Path(os.environ.get(ENV) or CHECKOUT / ".serve" / "llama.cpp")


def find_tools(
    root: Path | None = None, tools: tuple[str, ...] = TOOLS, what: str = "GGUF k-quants"
) -> dict[str, Path]:
    """`tools` under `root`/bin (default: `llama_cpp_root()`), or FileNotFoundError naming the build command
    (and `what` needs them)."""
    root = Path(root) if root is not None else llama_cpp_root()
    found = {name: root / "bin" / name for name in tools}
    missing = [name for name, path in found.items() if not (path.is_file() and os.access(path, os.X_OK))]
    if missing:
        raise FileNotFoundError(
            f"{what} come from llama.cpp's tools, and {', '.join(missing)} "
            f"{'are' if len(missing) > 1 else 'is'} not built in {root}/bin: run "
            f"`{BUILD}` (or set {ENV} to a build that has them)"
        )
    return found


def needed_tools(imatrix: bool = True) -> tuple[str, ...]:
    """What writing k-quants runs (module docstring, "Where the tools are"): llama-quantize alone without the
    importance matrix."""
    return TOOLS if imatrix else TOOLS[:1]


def check_quantize(types: Iterable[str], imatrix: bool = True) -> None:
    """Before any work: the tools are built where a k-quant is asked for, and no type needs a matrix it won't get."""
    asked = quantized(types)
    needs = [] if imatrix else [t for t in asked if t in NEEDS_IMATRIX]
    if needs:
        raise ValueError(
            f"GGUF type {needs} needs an importance matrix (llama-quantize refuses it without one): drop "
            "--no-imatrix / export.imatrix: false, or choose another type"
        )
    if asked:
        find_tools(tools=needed_tools(imatrix))


def _round_trips(tokenizer, text: str, ids: list[int]) -> bool:
    return tokenizer(text, add_special_tokens=False).input_ids == ids


def imatrix_text(tokenizer, windows: torch.Tensor, add_bos: bool = False) -> tuple[str, list[int]]:
    """(the text, the windows written in order) so that llama-imatrix with `-c` = the window length sees the
    windows themselves as its chunks (module docstring)."""
    rows = [w.tolist() for w in windows]
    drop = 1 if add_bos else 0  # the first chunk's first position becomes BOS: start at the second token
    pieces = [tokenizer.decode(r, clean_up_tokenization_spaces=False) for r in rows]
    ok = [i for i, (p, r) in enumerate(zip(pieces, rows)) if _round_trips(tokenizer, p, r)]
    first = next(
        (i for i in ok if drop == 0 or _round_trips(tokenizer, tokenizer.decode(rows[i][1:]), rows[i][1:])), None
    )
    if first is None:
        raise ValueError("no calibration window decodes to text that tokenizes back to it: no importance matrix")
    order, left = [first], [i for i in ok if i != first]
    while left:
        last = order[-1]
        nxt = next((j for j in left if _round_trips(tokenizer, pieces[last] + pieces[j], rows[last] + rows[j])), None)
        if nxt is None:
            break
        order.append(nxt)
        left.remove(nxt)
    text = tokenizer.decode(rows[first][drop:], clean_up_tokenization_spaces=False) + "".join(
        pieces[i] for i in order[1:]
    )
    expected = rows[first][drop:] + [t for i in order[1:] for t in rows[i]]
    if not _round_trips(tokenizer, text, expected):
        raise ValueError("the calibration windows written as one text do not tokenize back to themselves")
    return text, order


def run_tool(cmd: list, what: str, **kwargs) -> subprocess.CompletedProcess:
    """One of llama.cpp's tools (`kwargs`: `subprocess.run`'s `input`, `env`), or RuntimeError with its last words."""
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=False, **kwargs)
    if done.returncode:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"{what} failed (exit {done.returncode}): {tail}")
    return done


def threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def llama_tokens(tools: dict[str, Path], model: Path, text: Path) -> list[int]:
    """llama.cpp's token ids of a text file as llama-imatrix reads it (BOS added where the model asks for it)."""
    cmd = [tools["llama-tokenize"], "-m", model, "-f", text, "--ids", "--no-escape", "--log-disable"]
    out = run_tool(cmd, "llama-tokenize").stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("[")))


def compute_imatrix(
    tools: dict[str, Path], model: Path, tokenizer, windows: torch.Tensor, out: Path, log=print
) -> None:
    """Run llama-imatrix on `model` (an F32 file) over `windows`; the matrix goes to `out`."""
    add_bos = adds(tokenizer, tokenizer.bos_token_id)[0]  # llama-imatrix puts BOS where the tokenizer adds it
    n_ctx = int(windows.shape[1])
    text, order = imatrix_text(tokenizer, windows, add_bos)
    path = out.with_name(f"calibration-{len(order)}x{n_ctx}.txt")
    path.write_bytes(text.encode("utf-8"))
    flat = windows[order].flatten().tolist()
    expected = [tokenizer.bos_token_id] + flat[1:] if add_bos else flat  # llama-tokenize adds BOS as llama-imatrix
    got = llama_tokens(tools, model, path)
    if got != expected:
        at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        raise ValueError(
            f"llama.cpp tokenizes the calibration text differently from the run's windows (first at token {at} of "
            f"{len(expected)}): its importance matrix would not be over the same tokens"
        )
    batch = n_ctx * max(1, 2048 // n_ctx)  # llama-imatrix runs 2048 // n_ctx windows side by side
    cmd = [tools["llama-imatrix"], "-m", model, "-f", path, "-c", n_ctx, "-b", batch, "--chunks", len(order)]
    cmd += ["-o", out, "--no-ppl", "--parse-special", "-t", threads()]
    run_tool(cmd, "llama-imatrix")
    path.unlink()
    left_out = windows.shape[0] - len(order)
    log(
        f"importance matrix: llama-imatrix over {len(order)} calibration windows of {n_ctx} tokens ({left_out} left out)"
    )


def quantize_view(
    f32: Path,
    targets: dict[str, Path],
    *,
    tokenizer,
    calibration,
    imatrix: bool = True,
    log=print,
) -> None:
    """Write each of `targets` (type -> path) from the view's F32 file with llama-quantize (`llama-quantize
    [--imatrix M] source target TYPE`, written beside the target and renamed into place); with `imatrix`, one
    importance matrix over `calibration()` (the run's windows) serves every type."""
    tools = find_tools(tools=needed_tools(imatrix))
    with tempfile.TemporaryDirectory(dir=f32.parent, prefix=".imatrix-") as tmp:
        matrix = Path(tmp) / "imatrix.gguf" if imatrix else None
        if imatrix:
            compute_imatrix(tools, f32, tokenizer, calibration(), matrix, log)
        for gguf_type, target in targets.items():
            with atomic_path(target) as tmp:
                cmd = [tools["llama-quantize"]] + (["--imatrix", matrix] if matrix is not None else [])
                run_tool(cmd + [f32, tmp, gguf_type, threads()], f"llama-quantize {gguf_type}")
            log(f"llama-quantize {gguf_type}{' with the importance matrix' if matrix else ''}: {target}")
