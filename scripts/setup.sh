#!/usr/bin/env bash
# Create .venv and install the project with its dev tools.
# CPU-only machine: torch==2.13.0 is installed first (a CPU build where pip finds one: set TORCH_INDEX_URL,
# e.g. https://download.pytorch.org/whl/cpu, to avoid CUDA wheels); GPU machine: pip resolves CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip setuptools wheel
if ! command -v nvidia-smi >/dev/null 2>&1; then
  pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION:-2.13.0}"
fi
pip install -q -e ".[dev]"
python -c "import torch, deepspeed, transformers; print(f'torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}')" 2>&1 | grep -v -i warn || true
# LANS/LAMB's C++ CPU kernels are built on first use (torch's JIT extension builder, ~25 s, cached under
# ~/.cache/torch_extensions): build them now, so the first CPU training run does not stall on the compiler.
# Not fatal: without a compiler the optimizer falls back to torch.compile or foreach, with a warning.
python -c "from training.optim.cpu_ext import cpu_kernels; print('LANS/LAMB CPU kernels:', 'built' if cpu_kernels() is not None else 'not built (see the warning)')" 2>&1 | grep -v -i "accelerator to CPU" || true
