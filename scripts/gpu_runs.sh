#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu.sh installed the bundle: one training run per model family with train.py
# on the real vocabularies, each timed from its own summary.json, then Hugging Face Trainer on the same shards,
# same shapes and batches (benchmarks/bench_train_hf.py --device cuda):
#   bert      bert-large phase 1 (seq 128, max_pred 20), LANS, ZeRO-1, BF16
#   neox      neox-1.3b (seq 2048), AdamW, ZeRO-1, BF16
#   bert-peer, neox-peer: the Trainer (BF16 autocast, fused AdamW)
#   bash scripts/gpu_runs.sh BUNDLE_DIR
# Environment: OUT (default runs/gpu-runs): shards, run directories, logs and rows.jsonl (one line per run: the
# run's summary.json or the peer's record); PYTHON (default python3); TEXT: a text directory from
# `python -m data wiki` (default: built here from the bundle's sample); ROWS (default "bert neox bert-peer
# neox-peer"); DEADLINE (epoch seconds): runs that cannot get RUN_MIN_S before it are skipped, the others are
# cut at it or after RUN_MAX_S (170); BERT_MICRO/BERT_GLOBAL/BERT_STEPS (128/1024/20), NEOX_MICRO/NEOX_GLOBAL/NEOX_STEPS (8/32/14),
# WARMUP (3 steps kept out of the timing); BERT_MODEL/NEOX_MODEL, PEER_DEVICE, NUM_GPUS (a CPU dry run:
# BERT_MODEL=bert-debug NEOX_MODEL=neox-debug PEER_DEVICE=cpu and small batches). WIKIPRETRAIN_DEVICE_MEMORY_GIB:
# as scripts/gpu.sh (78 on a card bigger than an H100; the 2026-11-26 figures ran at 74.5, 80e9 bytes).
set -uo pipefail
BUNDLE=${1:?usage: bash scripts/gpu_runs.sh BUNDLE_DIR}
BUNDLE=$(cd "$BUNDLE" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu-runs}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SH=$BUNDLE/shared-data
ROWS=${ROWS:-bert neox bert-peer neox-peer}
DEADLINE=${DEADLINE:-$(($(date +%s) + 3600))}
RUN_MIN_S=${RUN_MIN_S:-45} RUN_MAX_S=${RUN_MAX_S:-170}
WARMUP=${WARMUP:-3}
BERT_MICRO=${BERT_MICRO:-128} BERT_GLOBAL=${BERT_GLOBAL:-1024} BERT_STEPS=${BERT_STEPS:-20}
NEOX_MICRO=${NEOX_MICRO:-8} NEOX_GLOBAL=${NEOX_GLOBAL:-32} NEOX_STEPS=${NEOX_STEPS:-14}
BERT_MODEL=${BERT_MODEL:-bert-large} NEOX_MODEL=${NEOX_MODEL:-neox-1.3b} PEER_DEVICE=${PEER_DEVICE:-cuda}
NUM_GPUS=${NUM_GPUS:-1}
. scripts/gpu_memory_cap.sh  # an H200 measured as an H100 80GB
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false
D=$OUT/data

if [ -z "${TEXT:-}" ]; then
  TEXT=$D/text
  "$PY" -m data wiki "$(ls "$BUNDLE"/sample/*.bz2 | head -1)" --out "$TEXT" --workers 4 --shards 4 --overwrite || exit 2
fi
mkdir -p "$D/text-train" "$D/text-eval"
cp "$TEXT"/wiki_0000[0-2].txt "$D/text-train/" && cp "$TEXT"/wiki_00003.txt "$D/text-eval/" || exit 2
"$PY" -m data bert --text "$D/text-train" --vocab "$SH/bert-base-uncased-vocab.txt" --out "$D/bert128/train" \
  --seq-len 128 --max-pred 20 --workers 4 --overwrite || exit 2
"$PY" -m data bert --text "$D/text-eval" --vocab "$SH/bert-base-uncased-vocab.txt" --out "$D/bert128/eval" \
  --seq-len 128 --max-pred 20 --dupe-factor 1 --overwrite || exit 2
"$PY" -m data gpt --text "$TEXT" --tokenizer "$SH/gpt-neox-20b-tokenizer.json" --out "$D/gpt2048/train" \
  --seq-len 2048 --overwrite || exit 2
"$PY" -m data gpt --text "$D/text-eval" --tokenizer "$SH/gpt-neox-20b-tokenizer.json" --out "$D/gpt2048/eval" \
  --seq-len 2048 --overwrite || exit 2

budget() {  # seconds a run may take now, or nothing when under RUN_MIN_S are left
  local left=$((DEADLINE - $(date +%s)))
  [ "$left" -ge "$RUN_MIN_S" ] && echo $((left < RUN_MAX_S ? left : RUN_MAX_S))
}

ours() {  # NAME CONFIG OVERRIDES...: train.py on one GPU under the deepspeed launcher
  local name=$1 config=$2 t
  shift 2
  t=$(budget) || { echo "== $name skipped: under ${RUN_MIN_S}s before DEADLINE"; return; }
  echo "== $name: train.py --config $config $* (limit ${t}s)"
  rm -rf "${OUT:?}/$name"
  timeout -k 10 "$t" "$PY" -m deepspeed.launcher.runner --num_gpus "$NUM_GPUS" --master_port 29617 train.py --config "$config" \
    run.dir="$OUT/$name" logging.every=5 logging.warmup_steps="$WARMUP" checkpoint.every=0 train.eval_every=0 \
    train.eval_samples=64 data.num_workers=4 "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit $?"
  tail -3 "$OUT/$name.log"
  [ -f "$OUT/$name/summary.json" ] && "$PY" -c "import json, sys
s = json.load(open(sys.argv[1])); s['row'] = sys.argv[2]; print(json.dumps(s))" "$OUT/$name/summary.json" "$name" \
    >> "$OUT/rows.jsonl"
}

peer() {  # NAME MODEL DATA STEPS MICRO GLOBAL
  local t
  t=$(budget) || { echo "== $1 skipped: under ${RUN_MIN_S}s before DEADLINE"; return; }
  echo "== $1: Trainer, $2 (limit ${t}s)"
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout -k 10 "$t" "$PY" benchmarks/bench_train_hf.py --device "$PEER_DEVICE" --model "$2" --data "$3" --steps "$4" \
    --warmup "$WARMUP" --micro-batch "$5" --global-batch "$6" --workers 4 --threads 4 --out "$OUT/$1.json" \
    > "$OUT/$1.log" 2>&1
  echo "$1 exit $?"
  tail -3 "$OUT/$1.log"
  [ -f "$OUT/$1.json" ] && "$PY" -c "import json, sys
s = json.load(open(sys.argv[1])); s['row'] = sys.argv[2]; print(json.dumps(s))" "$OUT/$1.json" "$1" >> "$OUT/rows.jsonl"
}

for row in $ROWS; do
  case $row in
    bert) ours bert bert-large-phase1 data.train="$D/bert128/train" data.eval="$D/bert128/eval" \
      data.vocab="$SH/bert-base-uncased-vocab.txt" model.name="$BERT_MODEL" optimizer.name=lans train.steps="$BERT_STEPS" \
      train.micro_batch="$BERT_MICRO" train.global_batch="$BERT_GLOBAL" ;;
    neox) ours neox neox-1.3b data.train="$D/gpt2048/train" data.eval="$D/gpt2048/eval" data.seq_len=2048 \
      data.vocab="$SH/gpt-neox-20b-tokenizer.json" model.name="$NEOX_MODEL" optimizer.name=adamw train.steps="$NEOX_STEPS" \
      train.micro_batch="$NEOX_MICRO" train.global_batch="$NEOX_GLOBAL" ;;
    bert-peer) peer bert-peer "$BERT_MODEL" "$D/bert128/train" "$BERT_STEPS" "$BERT_MICRO" "$BERT_GLOBAL" ;;
    neox-peer) peer neox-peer "$NEOX_MODEL" "$D/gpt2048/train" "$NEOX_STEPS" "$NEOX_MICRO" "$NEOX_GLOBAL" ;;
    *) echo "unknown row $row" >&2 ;;
  esac
done
echo "rows: $OUT/rows.jsonl"
