#!/usr/bin/env bash
# Serve MODEL_DIR with a real vLLM (OpenAI-compatible API) as "tiny-llama" on 127.0.0.1:PORT.
# Usage: scripts/real_vllm/start.sh VENV_DIR MODEL_DIR PORT [more `vllm serve` arguments]
# Ready in ~35-60 s, ~2.9 GB RSS. Stop it with SIGTERM to its PID.
set -euo pipefail
venv=${1:?usage: start.sh VENV_DIR MODEL_DIR PORT}; model=${2:?MODEL_DIR}; port=${3:?PORT}; shift 3
scratch=$(mktemp -d)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-auto}
export VLLM_CACHE_ROOT=$scratch/vllm TORCHINDUCTOR_CACHE_DIR=$scratch/inductor TMPDIR=$scratch
exec "$venv/bin/vllm" serve "$model" --served-model-name tiny-llama --host 127.0.0.1 --port "$port" \
  --max-model-len 256 --dtype float32 --enforce-eager "$@"
