#!/usr/bin/env bash
# Full-size Qwen3-Omni-30B-A3B (random bf16 weights drawn on the GPU, nothing downloaded) through the
# real preset on one GPU: time to first audio and real-time factor at 1, 4 and 8 concurrent
# requests, as a table (and evaluation/results/gpu_check_full.json). Self-contained: needs this
# repository with its Python dependencies installed, one CUDA GPU (an H200: ~75 GB are used), no
# network. Bounded to 8 minutes. Extra arguments go to evaluation/qwen3_gpu_check.py
# (e.g. --thinker-tokens 48; a CPU rehearsal: --size tiny --device cpu --dtype float32).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), '| transformers', transformers.__version__)"
exec timeout --signal=TERM --kill-after=20 470 python -m evaluation.qwen3_gpu_check "$@"
