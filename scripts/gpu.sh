#!/usr/bin/env bash
# The two calls of a lent GPU: install from the offline bundle, the attention operator's check, the training rows
# (ours beside the Hugging Face Trainer), the profile and the GPU tier, each step against the call's deadline,
# each run's record in $OUT/rows.jsonl the moment it ends. See scripts/gpu_calls.py (the steps), its cost table
# scripts/gpu_costs.json, and docs/gpu-notes.md.
#   bash scripts/gpu.sh --dry-run call1 BUNDLE_DIR     # the steps with their expected seconds, cold and warm totals
#   bash scripts/gpu.sh call1 BUNDLE_DIR               # on the GPU machine (BUNDLE_DIR: scripts/gpu_bundle.sh)
#   bash scripts/gpu.sh call2 BUNDLE_DIR               # at once after call 1 (the machine stays warm 30 s)
#   bash scripts/gpu.sh --cpu call1 BUNDLE_DIR         # the same steps on the CPU at debug sizes (CI)
# Without --cpu it refuses to run where torch sees no CUDA device (exit 2, one line).
# Environment: PYTHON (default python3: on the GPU image a venv with CUDA torch, everything is installed into it),
# OUT (runs/gpu), WORK (/tmp/wikipretrain-gpu), CALL_S (330), LARGEST=1, LANES (3), COSTS.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_calls.py "$@"
