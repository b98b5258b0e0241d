#!/usr/bin/env bash
# The GPU check (make gpu-check): on a CUDA machine, in under 8 minutes,
#  1. bf16 + per-block torch.compile training steps of every architecture at the paper's `small` size, measured
#     side by side (satlab bench: tokens/s, step time, peak memory, TFLOP/s, MFU against the dense bf16 peak);
#  2. one short run through the real Trainer path (satlab train, bf16-mixed, compiled) with MFU and memory logged;
#  3. with more than one GPU, 2-step FSDP and FSDP2 model-parallel runs.
# Everything it prints is also written under ${OUT:-reports/gpu_check}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-reports/gpu_check}
mkdir -p "$OUT"
SATLAB=${SATLAB:-.venv/bin/satlab}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
GPUS=$(nvidia-smi -L | wc -l)

echo "== 1. bench: every architecture, small size, bf16, compiled =="
"$SATLAB" bench --size small --batch 8 --seq-len 2048 --precision bf16-mixed --compile --rounds 8 --max-rounds 30 --warmup 3 \
  --no-overhead --out "$OUT/bench_small.json" 2>&1 | tee "$OUT/bench_small.txt"

# A small local corpus keeps the Trainer run offline; the model is the paper's small one.
TRAIN_ARGS=(model.size=small data.source=pystdlib data.tokenizer.kind=byte data.seq_len=2048
  train.micro_batch_size=8 train.global_batch_tokens=16384 train.max_tokens=327680 train.val_every_tokens=163840
  train.val_tokens=32768 train.precision=bf16-mixed train.compile=true train.accelerator=gpu
  "data.cache_dir=$OUT/cache" "train.out_dir=$OUT/runs" "tracking.uri=sqlite:///$PWD/$OUT/mlflow.db")

echo "== 2. satlab train: satformer small, bf16-mixed, compiled, 20 steps =="
"$SATLAB" train --no-progress name=gpu-satformer "${TRAIN_ARGS[@]}" 2>&1 | tee "$OUT/train_satformer.txt"

if [ "$GPUS" -gt 1 ]; then
  for strategy in fsdp model_parallel; do
    echo "== 3. $strategy on $GPUS GPUs, 2 steps =="
    "$SATLAB" train --no-progress "name=gpu-$strategy" "${TRAIN_ARGS[@]}" train.devices="$GPUS" \
      train.strategy="$strategy" train.global_batch_tokens=$((16384 * GPUS)) train.max_tokens=$((32768 * GPUS)) \
      2>&1 | tee "$OUT/train_$strategy.txt"
  done
else
  echo "== 3. one GPU: FSDP / model-parallel runs need 2 or more (their CPU path is tested by make test) =="
fi

.venv/bin/python - "$OUT" <<'PY'
import json, sys, mlflow
out = sys.argv[1]
client = mlflow.MlflowClient(f"sqlite:///{out}/mlflow.db")
for exp in client.search_experiments():
    for run in client.search_runs([exp.experiment_id]):
        m = run.data.metrics
        print(f"{run.info.run_name:22s} mfu={m.get('system/mfu', float('nan')):.3f} "
              f"tok/s={m.get('system/tokens_per_sec', float('nan')):,.0f} peak_mem_gb={m.get('system/peak_mem_gb', float('nan')):.1f} "
              f"val_loss={m.get('val/loss', float('nan')):.3f}")
PY
