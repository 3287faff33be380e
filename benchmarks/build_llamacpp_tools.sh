#!/usr/bin/env bash
# Builds llama.cpp's command-line tools (llama-perplexity, llama-quantize, llama-bench) from the
# llama.cpp that llama-cpp-python 0.3.36's sdist vendors, so the tools and the Python binding the
# benchmarks drive are the same llama.cpp. The build is for AVX-512 (+VNNI, BF16) without AMX: AMX
# tiles fault (SIGILL) on VMs that hide them, and GGML_NATIVE would pick them up, so it is off.
# Usage: benchmarks/build_llamacpp_tools.sh
#   RIVALS   where the rivals live (default /work/rivals): the sdist is unpacked there and the
#            tools land in $RIVALS/llamacpp-tools/bin
#   PIP      a pip to download the sdist with (default $RIVALS/llamacpp/bin/pip)
#   JOBS     parallel compile jobs (default 2); the build runs under nice
set -euo pipefail

RIVALS=${RIVALS:-/work/rivals}
PIP=${PIP:-$RIVALS/llamacpp/bin/pip}
JOBS=${JOBS:-2}
VERSION=0.3.36
SDIST=$RIVALS/sdist/llama_cpp_python-$VERSION.tar.gz
SRC=$RIVALS/llama_cpp_python-$VERSION/vendor/llama.cpp
BUILD=$RIVALS/llamacpp-tools

if [ ! -f "$SDIST" ]; then
    "$PIP" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$RIVALS/sdist"
fi
if [ ! -d "$SRC" ]; then
    tar xzf "$SDIST" -C "$RIVALS"
fi

cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
    -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF
nice -n 10 cmake --build "$BUILD" -j "$JOBS" --target llama-perplexity llama-quantize llama-bench
ls -l "$BUILD/bin/llama-perplexity" "$BUILD/bin/llama-quantize" "$BUILD/bin/llama-bench"
