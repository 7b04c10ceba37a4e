# Sourced by scripts/gpu.sh and scripts/gpu_runs.sh. On a card with more memory than an H100 80GB (an H200), the
# runs are capped at 78 GiB (WIKIPRETRAIN_DEVICE_MEMORY_GIB: what an H100 80GB leaves its allocator after the
# CUDA context and library buffers), so that the card is measured as an H100; a value already set is kept.
if [ -z "${WIKIPRETRAIN_DEVICE_MEMORY_GIB:-}" ]; then
  TOTAL_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 || true)
  if [ -n "$TOTAL_MIB" ] && [ "$TOTAL_MIB" -gt 82000 ]; then
    export WIKIPRETRAIN_DEVICE_MEMORY_GIB=78
  fi
fi
