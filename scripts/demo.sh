#!/usr/bin/env bash
# End to end on the built-in sample, CPU only, a few minutes:
#   enwiki sample dump (gensim wheel) -> clean sentence-split text -> WordPiece vocab -> BERT HDF5 shards
#   -> bert-debug with DeepSpeed ZeRO-2, BF16, LANS on 2 CPU ranks -> checkpoint -> resume -> evaluate -> summary
# Environment: DEMO_DIR (default runs/demo), RANKS (default 2), STEPS (default 40).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
DEMO_DIR=${DEMO_DIR:-runs/demo}
RANKS=${RANKS:-2}
STEPS=${STEPS:-40}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

DUMP=$(python -c "from data.sample import sample_dump_path; print(sample_dump_path())")
echo "== 1/5 text: $DUMP"
python -m data wiki "$DUMP" --out "$DEMO_DIR/text" --workers 2 --shards 4 --overwrite
# Hold one text shard out for evaluation.
rm -rf "$DEMO_DIR/text-train" "$DEMO_DIR/text-eval"
mkdir -p "$DEMO_DIR/text-train" "$DEMO_DIR/text-eval"
cp "$DEMO_DIR"/text/wiki_0000[0-2].txt "$DEMO_DIR/text-train/"
cp "$DEMO_DIR"/text/wiki_00003.txt "$DEMO_DIR/text-eval/"

echo "== 2/5 vocabulary (WordPiece, built from the sample)"
python -m data vocab "$DEMO_DIR/text-train" --out "$DEMO_DIR/vocab.txt" --size 8000

echo "== 3/5 BERT shards (seq 128, max_pred 20)"
python -m data bert --text "$DEMO_DIR/text-train" --vocab "$DEMO_DIR/vocab.txt" --out "$DEMO_DIR/bert128/train" \
  --seq-len 128 --max-pred 20 --workers 2 --overwrite
python -m data bert --text "$DEMO_DIR/text-eval" --vocab "$DEMO_DIR/vocab.txt" --out "$DEMO_DIR/bert128/eval" \
  --seq-len 128 --max-pred 20 --dupe-factor 1 --overwrite

COMMON=(--config smoke run.dir="$DEMO_DIR/run" data.train="$DEMO_DIR/bert128/train" data.eval="$DEMO_DIR/bert128/eval"
        data.vocab="$DEMO_DIR/vocab.txt" train.steps="$STEPS" checkpoint.resume=auto)
rm -rf "$DEMO_DIR/run"
HALF=$((STEPS / 2))
echo "== 4/5 train bert-debug on $RANKS CPU ranks: ZeRO-2, BF16, LANS; stop with a checkpoint at step $HALF"
deepspeed --num_gpus "$RANKS" train.py "${COMMON[@]}" train.stop_at_step="$HALF"

echo "== 5/5 resume from the checkpoint and finish (evaluation at the end)"
deepspeed --num_gpus "$RANKS" train.py "${COMMON[@]}"

python - "$DEMO_DIR/run/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"\nsummary ({sys.argv[1]}):")
for k in ("model", "world_size", "zero_stage", "precision", "optimizer", "steps", "final_loss", "sequences_per_sec",
          "tokens_per_sec", "tflops_per_device", "mfu", "eval_mlm_accuracy", "eval_nsp_accuracy", "peak_memory_bytes"):
    if k in s:
        v = s[k]
        print(f"  {k:<20} {v:.4g}" if isinstance(v, float) else f"  {k:<20} {v}")
PY
