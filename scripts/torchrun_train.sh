#!/usr/bin/env bash
# Multi-node training with torchrun (no SLURM): run this on every node with the same RDZV_ENDPOINT.
#   NNODES=2 NPROC=8 RDZV_ENDPOINT=node0:29500 scripts/torchrun_train.sh experiment=paper/medium/satformer
# Lightning detects the torchelastic environment, so it does not launch processes itself.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/torchrun --nnodes="${NNODES:-1}" --nproc-per-node="${NPROC:-8}" --rdzv-backend=c10d \
  --rdzv-endpoint="${RDZV_ENDPOINT:-127.0.0.1:29500}" --rdzv-id="${RDZV_ID:-satlab}" \
  -m satlab.cli.main train --no-progress "$@" train.num_nodes="${NNODES:-1}" train.devices="${NPROC:-8}" \
  train.strategy="${STRATEGY:-model_parallel}" train.accelerator=gpu
