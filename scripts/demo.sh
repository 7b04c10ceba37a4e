#!/usr/bin/env bash
# End to end on the built-in sample, CPU only, a few minutes:
#   enwiki sample dump (gensim wheel) -> clean sentence-split text -> WordPiece vocab -> BERT HDF5 shards
#   -> bert-debug with DeepSpeed ZeRO-2 and LANS on 2 CPU ranks -> checkpoint -> resume -> evaluate -> summary
#   -> loss curve PNG, and the held-out MLM accuracy against always predicting the most frequent token.
# Environment: DEMO_DIR (default runs/demo), RANKS (default 2), STEPS (default 400), PRECISION (default: bf16
# where the CPU computes BF16 natively, else fp32).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
DEMO_DIR=${DEMO_DIR:-runs/demo}
RANKS=${RANKS:-2}
STEPS=${STEPS:-400}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

DUMP=$(python -c "from data.sample import sample_dump_path; print(sample_dump_path())")
echo "== 1/6 text: $DUMP"
python -m data wiki "$DUMP" --out "$DEMO_DIR/text" --workers 2 --shards 4 --overwrite
# Hold one text shard out for evaluation.
rm -rf "$DEMO_DIR/text-train" "$DEMO_DIR/text-eval"
mkdir -p "$DEMO_DIR/text-train" "$DEMO_DIR/text-eval"
cp "$DEMO_DIR"/text/wiki_0000[0-2].txt "$DEMO_DIR/text-train/"
cp "$DEMO_DIR"/text/wiki_00003.txt "$DEMO_DIR/text-eval/"

echo "== 2/6 vocabulary (WordPiece, built from the sample)"
python -m data vocab "$DEMO_DIR/text-train" --out "$DEMO_DIR/vocab.txt" --size 8000

echo "== 3/6 BERT shards (seq 128, max_pred 20)"
python -m data bert --text "$DEMO_DIR/text-train" --vocab "$DEMO_DIR/vocab.txt" --out "$DEMO_DIR/bert128/train" \
  --seq-len 128 --max-pred 20 --workers 2 --overwrite
python -m data bert --text "$DEMO_DIR/text-eval" --vocab "$DEMO_DIR/vocab.txt" --out "$DEMO_DIR/bert128/eval" \
  --seq-len 128 --max-pred 20 --dupe-factor 1 --overwrite

if [ -z "${PRECISION:-}" ]; then
  echo "   checking whether this CPU computes BF16 natively (a one-off matmul measurement, cached)"
  PRECISION=$(python -c "from training.engine import quiet; quiet()
from training.devices import bf16_is_native; print('bf16' if bf16_is_native() else 'fp32')" | tail -n 1)
  [ "$PRECISION" = fp32 ] && echo "   BF16 is emulated on this CPU: the demo trains in FP32, which runs at native speed here"
fi

COMMON=(--config smoke run.dir="$DEMO_DIR/run" data.train="$DEMO_DIR/bert128/train" data.eval="$DEMO_DIR/bert128/eval"
        data.vocab="$DEMO_DIR/vocab.txt" train.steps="$STEPS" deepspeed.precision="$PRECISION" checkpoint.resume=auto
        optimizer.lr=1e-2 schedule.warmup=0.02 schedule.constant=0 train.eval_every=100 train.eval_samples=256
        logging.every=20 checkpoint.every=100)
rm -rf "$DEMO_DIR/run"
HALF=$((STEPS / 2))
echo "== 4/6 train bert-debug on $RANKS CPU ranks: ZeRO-2, $PRECISION, LANS; stop with a checkpoint at step $HALF"
rc=0
deepspeed --num_gpus "$RANKS" train.py "${COMMON[@]}" train.stop_at_step="$HALF" || rc=$?
if [ "$rc" -ne 3 ]; then  # 3: stopped on purpose with a checkpoint (as after SIGTERM)
  echo "training stopped with exit code $rc, expected 3" >&2
  exit 1
fi

echo "== 5/6 resume from the checkpoint and finish (evaluation at the end)"
deepspeed --num_gpus "$RANKS" train.py "${COMMON[@]}"

echo "== 6/6 learning curve and the baseline"
python -m launch curve "$DEMO_DIR/run" --eval-data "$DEMO_DIR/bert128/eval" --out "$DEMO_DIR/loss_curve.png"

python - "$DEMO_DIR/run/summary.json" "$DEMO_DIR/loss_curve.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
baseline = json.load(open(sys.argv[2]))["mlm_majority_accuracy"]
print(f"\nsummary ({sys.argv[1]}):")
for k in ("model", "world_size", "zero_stage", "precision", "optimizer", "steps", "final_loss", "eval_mlm_loss",
          "eval_nsp_loss", "eval_mlm_accuracy", "eval_nsp_accuracy", "sequences_per_sec", "tokens_per_sec",
          "tflops_per_device", "mfu", "startup_s", "train_window_s", "eval_s", "save_s", "peak_memory_bytes"):
    if k in s and s[k] is not None:
        v = s[k]
        print(f"  {k:<20} {v:.4g}" if isinstance(v, float) else f"  {k:<20} {v}")
acc = s["eval_mlm_accuracy"]
print(f"\nheld-out MLM accuracy {acc:.3f} against {baseline:.3f} for always predicting the most frequent token "
      f"({acc / baseline:.1f}x); the loss is MLM + NSP ({s['eval_mlm_loss']:.3f} + {s['eval_nsp_loss']:.3f})")
PY
