#!/usr/bin/env bash
# Build, on a machine with internet, the offline bundle for the GPU machine that scripts/gpu.sh runs on:
# CPython 3.12, manylinux_2_28 / manylinux2014 x86_64, which already has torch 2.11 (CUDA), transformers,
# h5py, tokenizers, numpy and pyarrow. The bundle carries the project, a DeepSpeed wheel built from its
# sdist, the few small packages the machine lacks, pytest (extra "test"), setuptools (for `pip install -e .`
# offline) and the enwiki sample dump. See docs/offline-install.md.
#   bash scripts/gpu_bundle.sh DIR
# Environment: PYTHON (default .venv/bin/python, else python3); TARGET_FREEZE: the GPU machine's `pip freeze`
# (scripts/gpu.sh saves it as OUT/pip-freeze-before.txt), used instead of the built-in list when given;
# MAX_MIB (default 64): refuse a bigger bundle.
set -euo pipefail
DIR=${1:?usage: bash scripts/gpu_bundle.sh DIR}
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
MAX_MIB=${MAX_MIB:-64}

ARGS=(--out "$DIR" --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
      --extras test --sample --build-backend)
if [ -n "${TARGET_FREEZE:-}" ]; then
  ARGS+=(--target-freeze "$TARGET_FREEZE")
else
  # Versions not given are taken from this machine (the project is tested with them); torch is the GPU one's.
  ARGS+=(--have torch==2.11.0 --have transformers --have h5py --have tokenizers --have numpy --have pyarrow)
fi
"$PY" -m launch bundle "${ARGS[@]}"
# The real uncased vocabulary and the GPT-NeoX-20B tokenizer (../shared does not travel): scripts/gpu.sh points
# the tests that read them at this copy (WIKIPRETRAIN_SHARED_DATA).
SHARED=${SHARED_DATA:-../shared/data}
mkdir -p "$DIR/shared-data"
for f in bert-base-uncased-vocab.txt gpt-neox-20b-tokenizer.json; do
  if [ -f "$SHARED/$f" ]; then
    cp "$SHARED/$f" "$DIR/shared-data/"
  else
    echo "warning: $SHARED/$f not found: the GPU machine's tests that read it will skip" >&2
  fi
done

BYTES=$(du -sb "$DIR" | cut -f1)
if [ "$BYTES" -gt $((MAX_MIB * 1024 * 1024)) ]; then
  echo "error: $DIR: bundle is $((BYTES / 1024 / 1024)) MiB, over MAX_MIB=$MAX_MIB" >&2
  exit 2
fi
echo "bundle for the GPU machine: $DIR ($((BYTES / 1024)) KiB); there: bash scripts/gpu.sh call1 $DIR, then call2 (--dry-run: the plan)"
