#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-batched-bench (or TARGETS) for the local NVIDIA GPU.
# usage: build_llamacpp.sh SRC (a llama.cpp source folder or .tgz) BUILD_DIR [CUDA_ARCH] [TARGETS]
#   TARGETS: e.g. "llama-lookup llama-speculative" (bench/llamacpp_spec.py)
# llama.cpp's source ships in the llama-cpp-python sdist on PyPI under vendor/llama.cpp:
#   pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
set -euo pipefail
src=$1; build=$2; arch=${3:-90}; targets=${4:-llama-bench llama-batched-bench}
mkdir -p "$build"
if [[ -f $src ]]; then
  mkdir -p "$build/src" && tar xzf "$src" -C "$build/src" && src=$(ls -d "$build"/src/*/ | head -1)
fi
cmake -S "$src" -B "$build/out" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON \
  -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release > "$build/cmake.log" 2>&1
# shellcheck disable=SC2086  # one target per word
cmake --build "$build/out" -j"$(nproc)" --target $targets \
  > "$build/build.log" 2>&1
ls "$build/out/bin/"
