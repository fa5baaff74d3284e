#!/usr/bin/env bash
# Builds the llama.cpp tools the GGUF serving check uses into .serve/llama.cpp (ignored by git):
#   bin/llama-perplexity   llama.cpp's perplexity tool
#   bin/llama-simple       its minimal greedy generation example (prints text)
#   bin/llama-tokenize     its tokenizer (--ids prints token ids)
#   bin/llama-quantize     its quantizer: the k-quants of `export --gguf-types Q4_K_M ...`
#   bin/llama-imatrix      its importance matrix over calibration text, for llama-quantize --imatrix
#   bin/llama-greedy-ids   scripts/serving/llama_greedy.cpp: greedy continuation of token-id prompts, as ids
#   src/                   the llama.cpp sources, with convert_hf_to_gguf.py and gguf-py
#   pydeps/                sentencepiece, which convert_hf_to_gguf.py imports (PYTHONPATH=src/gguf-py:pydeps)
# llama.cpp comes from the sdist of llama-cpp-python on PyPI (which vendors it), so PyPI is all it needs;
# gcc, cmake and ninja do the build (about 6 minutes on 2 cores). Idempotent: a finished build (the stamp
# file names the version and the targets) is left as it is, and one of the same version that lacks a target
# only builds that target; LLAMA_CPP_PYTHON_VERSION picks another version.
#   bash scripts/serving/llama_cpp.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
root=.serve/llama.cpp
stamp="$root/complete"
targets=(llama-perplexity llama-simple llama-tokenize llama-quantize llama-imatrix)
# The stamp names the greedy tool's source too: a changed scripts/serving/llama_greedy.cpp is compiled again.
want="llama-cpp-python==$version ${targets[*]} greedy:$(sha256sum scripts/serving/llama_greedy.cpp | cut -c1-16)"
pip=(python3 -m pip)
for venv in .venv-serve .venv; do [ -x "$venv/bin/pip" ] && { pip=("$venv/bin/pip"); break; }; done
greedy_tool() {
  g++ -O2 -std=c++17 scripts/serving/llama_greedy.cpp -I"$root/src/include" -I"$root/src/ggml/include" \
    -L"$root/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,'$ORIGIN' -o "$root/build/bin/llama-greedy-ids"
  ln -sfn build/bin "$root/bin"
  "$root/bin/llama-greedy-ids" 2>/dev/null || [ $? -eq 2 ]  # loads its libraries (usage exits 2)
}
pydeps() {
  # convert_hf_to_gguf.py imports sentencepiece before it looks for a tokenizer.json; it goes beside the
  # build (PYTHONPATH=src/gguf-py:pydeps), not into an environment.
  [ -d "$root/pydeps/sentencepiece" ] || "${pip[@]}" install -q --disable-pip-version-check --no-deps \
    --target "$root/pydeps" sentencepiece
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  pydeps
  echo "llama.cpp from llama-cpp-python==$version is built in $root"
  exit 0
fi
for tool in gcc g++ cmake ninja; do
  command -v "$tool" >/dev/null || { echo "error: '$tool' not found; the llama.cpp build needs gcc, g++, cmake, ninja" >&2; exit 2; }
done
if [ -f "$stamp" ] && [ "$(cut -d' ' -f1 "$stamp")" = "llama-cpp-python==$version" ]; then
  # The same sources, built before with fewer targets or another greedy tool: build what is missing (ninja
  # reuses the rest).
  cmake --build "$root/build" --target "${targets[@]}"
  greedy_tool
  pydeps
  echo "$want" >"$stamp"
  echo "llama.cpp from llama-cpp-python==$version is built in $root"
  exit 0
fi
rm -rf "$root"
mkdir -p "$root/download"
"${pip[@]}" download -q --disable-pip-version-check --no-deps --no-binary :all: -d "$root/download" \
  "llama-cpp-python==$version"
tar -xzf "$root/download/llama_cpp_python-$version.tar.gz" -C "$root/download"
mv "$root/download/llama_cpp_python-$version/vendor/llama.cpp" "$root/src"
rm -rf "$root/download"
# Shared libraries, so that llama-greedy-ids links against the same libllama as the tools. No server, no
# tests, no HTTPS: only the targets named below (and what they need) are built.
cmake -S "$root/src" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF >/dev/null
cmake --build "$root/build" --target "${targets[@]}"
greedy_tool
pydeps
echo "$want" >"$stamp"
echo "llama.cpp from llama-cpp-python==$version is built in $root"
