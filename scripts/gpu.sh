#!/usr/bin/env bash
# On a GPU machine without internet: install the project from an offline bundle, build small BERT and
# GPT-NeoX shards from the bundled enwiki sample, run a short one-GPU training, then the GPU test tier
# (pytest -m cuda) and, when asked (ROWS), the benchmark rows (benchmarks/bench_train.py --rows: ours beside
# the Trainer, each side also at its largest micro-batch).
#   bash scripts/gpu.sh BUNDLE_DIR     (BUNDLE_DIR from scripts/gpu_bundle.sh; see docs/offline-install.md)
#   TIER=0 SMOKE_STEPS=0 ROWS=bert-large-p1 bash scripts/gpu.sh BUNDLE_DIR     (one row only)
# Environment: OUT (default runs/gpu): logs, data, runs and pytest results; PYTHON (default python3): the
# interpreter that already holds the GPU build of torch (on the GPU image, python3 is itself a venv with
# torch, transformers, accelerate and pytest); everything is installed into it, never into a new venv, which
# would lose that torch. SMOKE_STEPS (default 20, 0 skips the training run); PYTEST_ARGS: more pytest
# arguments. The tests build their own shards from WIKIPRETRAIN_SAMPLE_DUMP (the bundle's sample .bz2).
# TIER (default 1; 0 skips the tier). ROWS: "all" or comma-separated rows of bench_train.py (bert-large-p1,
# bert-large-p2, neox-1.3b), run after the tier on the bundle's real vocabulary and tokenizer, results in
# OUT/rows.json and OUT/rows.log; ROW_STEPS/ROW_WARMUP (6/2) measured and warm-up steps per run.
# WIKIPRETRAIN_DEVICE_MEMORY_GIB: cap the GPU's memory (default 78 GiB on a card with more than an H100's
# 81,559 MiB: what an H100 80GB leaves its allocator after the CUDA context and library buffers).
set -euo pipefail
BUNDLE=${1:?usage: bash scripts/gpu.sh BUNDLE_DIR}
if [ ! -f "$BUNDLE/MANIFEST.json" ]; then
  echo "error: $BUNDLE: no MANIFEST.json, not a bundle from python -m launch bundle" >&2
  exit 2
fi
BUNDLE=$(cd "$BUNDLE" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SMOKE_STEPS=${SMOKE_STEPS:-20}
# The real vocabulary and tokenizer the bundle carries, for the tests that read them (tests/conftest.py)
[ -d "$BUNDLE/shared-data" ] && export WIKIPRETRAIN_SHARED_DATA="$BUNDLE/shared-data"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
DUMP=$(ls "$BUNDLE"/sample/*.bz2 2>/dev/null | head -1 || true)
if [ -z "$DUMP" ]; then
  echo "error: $BUNDLE/sample: no .bz2 sample dump; build the bundle with --sample" >&2
  exit 2
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "error: $PY: import torch sees no CUDA device (torch missing, a CPU build, or no GPU visible)" >&2
  exit 2
fi

. scripts/gpu_memory_cap.sh  # an H200 measured as an H100 80GB

echo "== 1/5 install from $BUNDLE (pip --no-index)"
{ nvidia-smi || true; } > "$OUT/nvidia-smi.txt" 2>&1
"$PY" -m pip freeze > "$OUT/pip-freeze-before.txt"  # TARGET_FREEZE for the next bundle
"$PY" -m pip install --no-index --find-links "$BUNDLE" 'wikipretrain[test]' 2>&1 | tee "$OUT/pip-install.log"
if [ -f pyproject.toml ] && [ -f train.py ]; then
  # A checkout: run its code, not the wheel's copy (the bundle carries setuptools for the offline build).
  "$PY" -m pip install --no-index --find-links "$BUNDLE" --no-deps -e . 2>&1 | tee -a "$OUT/pip-install.log"
fi
"$PY" -c "import torch, deepspeed, transformers, training
print('device', torch.cuda.get_device_name(), 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, 'project', training.__file__)" \
  | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$OUT/versions.txt" 2>&1 || true

D=$OUT/data
echo "== 2/5 text and tokenizers from $DUMP"
"$PY" -m data wiki "$DUMP" --out "$D/text" --workers 4 --shards 4 --overwrite
rm -rf "$D/text-train" "$D/text-eval"
mkdir -p "$D/text-train" "$D/text-eval"
cp "$D"/text/wiki_0000[0-2].txt "$D/text-train/"
cp "$D"/text/wiki_00003.txt "$D/text-eval/"
"$PY" -m data vocab "$D/text-train" --out "$D/vocab.txt" --size 8000
"$PY" -m data vocab "$D/text-train" --kind bpe --out "$D/tokenizer.json" --size 8000

echo "== 3/5 BERT shards (seq 128) and GPT-NeoX shards (seq 512)"
"$PY" -m data bert --text "$D/text-train" --vocab "$D/vocab.txt" --out "$D/bert128/train" --seq-len 128 \
  --max-pred 20 --workers 4 --overwrite
"$PY" -m data bert --text "$D/text-eval" --vocab "$D/vocab.txt" --out "$D/bert128/eval" --seq-len 128 \
  --max-pred 20 --dupe-factor 1 --overwrite
"$PY" -m data gpt --text "$D/text-train" --tokenizer "$D/tokenizer.json" --out "$D/gpt512/train" \
  --seq-len 512 --overwrite
"$PY" -m data gpt --text "$D/text-eval" --tokenizer "$D/tokenizer.json" --out "$D/gpt512/eval" \
  --seq-len 512 --overwrite
export WIKIPRETRAIN_SAMPLE_DUMP=$DUMP

if [ "$SMOKE_STEPS" -gt 0 ]; then
  echo "== 4/5 bert-debug on one GPU with DeepSpeed, $SMOKE_STEPS steps"
  rm -rf "$OUT/smoke"
  "$PY" -m deepspeed.launcher.runner --num_gpus 1 train.py --config smoke run.dir="$OUT/smoke" \
    data.train="$D/bert128/train" data.eval="$D/bert128/eval" data.vocab="$D/vocab.txt" \
    train.steps="$SMOKE_STEPS" 2>&1 | tee "$OUT/smoke.log"
else
  echo "== 4/5 training run skipped (SMOKE_STEPS=0)"
fi

RC=0
if [ "${TIER:-1}" != 0 ]; then
  echo "== 5/5 GPU tier: pytest -m cuda"
  set +e
  # shellcheck disable=SC2086
  "$PY" -m pytest -m cuda -q -p no:cacheprovider --junitxml "$OUT/pytest-cuda.xml" ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/pytest-cuda.log"
  RC=${PIPESTATUS[0]}
  set -e
  echo "pytest -m cuda exit $RC; results in $OUT (pytest-cuda.xml, pytest-cuda.log, smoke/summary.json)"
else
  echo "== 5/5 GPU tier skipped (TIER=0)"
fi

if [ -n "${ROWS:-}" ]; then
  echo "== rows: $ROWS"
  VOCABS=()
  SD=$BUNDLE/shared-data
  [ -f "$SD/bert-base-uncased-vocab.txt" ] && VOCABS+=(--vocab "$SD/bert-base-uncased-vocab.txt")
  [ -f "$SD/gpt-neox-20b-tokenizer.json" ] && VOCABS+=(--tokenizer "$SD/gpt-neox-20b-tokenizer.json")
  set +e
  "$PY" benchmarks/bench_train.py --rows "$ROWS" --largest --steps "${ROW_STEPS:-6}" --warmup "${ROW_WARMUP:-2}" \
    --threads 4 --work "$OUT/bench" --json "$OUT/rows.json" ${VOCABS[@]+"${VOCABS[@]}"} 2>&1 | tee "$OUT/rows.log"
  ROWS_RC=${PIPESTATUS[0]}
  set -e
  echo "rows exit $ROWS_RC; results in $OUT/rows.json, $OUT/rows.log (runs' logs under $OUT/bench/logs)"
  [ "$RC" = 0 ] && RC=$ROWS_RC
fi
exit "$RC"
