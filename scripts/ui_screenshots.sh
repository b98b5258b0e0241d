#!/usr/bin/env bash
# Screenshots of the views satlab hands over, each taken only once the page shows its content (else exit 1):
#   runs_comparison.png    two tiny runs (Transformer, SATFormer) from the URL `satlab train` prints: val/loss overlaid
#   ablation_comparison.png a 2 x 2 micro ablation's cells from the URL `satlab ablate` prints
#   ablation_parent.png    the ablation's parent run: its results as metrics
#   ablation_report.png    the parent's report.html in MLflow's artifact view, its figures shown
#   dashboard.png          optuna-dashboard of a 3-trial sweep, its best trial the one `satlab sweep` names
# Needs Debian's chromium (apt-get install chromium) and about 10 minutes on 2 cores; tests/test_views.py runs it
# (marked slow). Usage: scripts/ui_screenshots.sh [OUT_DIR]   (default reports/ui)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-reports/ui}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
command -v chromium >/dev/null || { echo "needs chromium: apt-get install -y chromium" >&2; exit 2; }
WORK=$(mktemp -d)
STORE="sqlite:///$WORK/mlruns/mlflow.db"
mkdir -p "$WORK/mlruns"
PIDS=()
cleanup() {  # the servers run in their own process groups (setsid): uvicorn's shutdown signals its whole group
  local status=$?
  for pid in "${PIDS[@]}"; do kill -- "-$pid" 2>/dev/null; done
  if [ "$status" = 0 ]; then rm -rf "$WORK"; else echo "failed; the runs and logs are kept in $WORK" >&2; fi
  exit "$status"
}
trap cleanup EXIT
free_port() { $PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
wait_for() { for _ in $(seq 240); do curl -sf "$1" >/dev/null && return 0; sleep 0.5; done; echo "no answer: $1" >&2; exit 1; }

TINY=(model.d_model=32 model.n_layers=2 model.n_heads=2 model.mlp_hidden=64 data.tokenizer.kind=byte data.seq_len=64
      train.micro_batch_size=4 train.global_batch_tokens=256 train.val_tokens=256 train.accelerator=cpu
      "data.cache_dir=$WORK/cache" "tracking.uri=$STORE")
$PY -c "import mlflow; mlflow.MlflowClient('$STORE').search_experiments()"   # create the store before any writer
echo "training two tiny runs"
for arch in transformer satformer; do
  $PY -m satlab.cli.main train "experiment=tiny/$arch" --no-progress "${TINY[@]}" train.max_tokens=8192 \
    train.val_every_tokens=2048 train.log_every_n_steps=1 eval.limit=4 "train.out_dir=$WORK/runs" \
    > "$WORK/train-$arch.log" 2>&1
done
cat > "$WORK/micro_ablation.yml" <<YAML
name: ui_micro
description: two architectures, two seeds, a few seconds each
base: default
out_dir: $WORK/ablation
axes: {model.arch: [transformer, satformer], train.seed: [0, 1]}
baseline: {model.arch: transformer}
YAML
echo "running a 2 x 2 ablation"
$PY -m satlab.cli.main ablate "$WORK/micro_ablation.yml" --workers 2 "${TINY[@]}" train.max_tokens=4096 \
  train.val_every_tokens=1024 eval.limit=4 "train.out_dir=$WORK/runs" > "$WORK/ablate.log" 2>&1
cat > "$WORK/micro_sweep.yaml" <<YAML
name: ui_sweep
description: learning rate of two architectures, three trials
base: default
space: {model.arch: {choices: [transformer, satformer]}, optim.lr: {low: 1.0e-4, high: 1.0, log: true}}
objective: {metric: val/loss, direction: minimize}
n_trials: 3
sampler: {name: random, seed: 3}
pruner: {name: none}
# A guard that prunes (the default only observes, and sets no constraint) at threshold 0: any saturated gate breaks
# the constraint, and with this patience never stops a trial. SATFormer's trial 0 completes infeasible, with (at this
# learning rate) a better val/loss than the Transformer's trial 1, which both views must name best.
saturation: {threshold: 0.0, patience: 1000, windows: 4, action: prune}
enqueue: [{model.arch: satformer, optim.lr: 0.03}, {model.arch: transformer, optim.lr: 0.001}]
out_dir: $WORK/sweep
YAML
SWEEP=("$WORK/micro_sweep.yaml" "${TINY[@]/#/overrides.}" overrides.train.max_tokens=4096
       overrides.train.val_every_tokens=1024)
echo "running a 3-trial sweep"
$PY -m satlab.cli.main sweep "${SWEEP[@]}" > "$WORK/sweep.log" 2>&1

PORT=$(free_port)
setsid $PY -m mlflow server --backend-store-uri "$STORE" --default-artifact-root "$WORK/mlruns/artifacts" \
  --host 127.0.0.1 --port "$PORT" > "$WORK/server.log" 2>&1 &
PIDS+=($!)
DASH=$(free_port)
setsid $PY -m satlab.cli.main sweep "${SWEEP[@]}" --dashboard --port "$DASH" > "$WORK/dashboard.log" 2>&1 &
PIDS+=($!)
wait_for "http://127.0.0.1:$PORT/health"
wait_for "http://127.0.0.1:$DASH/"

# The URLs the commands printed (for the store's default address), pointed at this server; satlab's best trial.
url_of() { grep -o 'http://127.0.0.1:5000/#/experiments/[^ ]*viewStateShareKey=[^ ]*' "$1" | tail -1 \
           | sed "s/127.0.0.1:5000/127.0.0.1:$PORT/"; }
RUNS_URL=$(url_of "$WORK/train-satformer.log")
ABLATION_URL=$(url_of "$WORK/ablate.log")
PARENT_URL=$(grep -o "the study's results: http://127.0.0.1:5000/[^ ]*" "$WORK/ablate.log" | tail -1 \
             | sed "s/.*results: //; s/127.0.0.1:5000/127.0.0.1:$PORT/")
read -r BEST STUDY_ID < <($PY - "$WORK/micro_sweep.yaml" <<'PYEOF'
import sys
import optuna
from satlab.studies.best import best_trial
from satlab.studies.loader import load_sweep
spec = load_sweep(sys.argv[1])
study = optuna.load_study(study_name=spec.name, storage=spec.storage_url())
print(best_trial(study.trials, spec.objective.direction).number, study._study_id)
PYEOF
)
SUMMARY_BEST=$(grep -o '^best: trial [0-9]*' "$WORK/sweep.log" | grep -o '[0-9]*$')
[ "$SUMMARY_BEST" = "$BEST" ] || { echo "satlab sweep's summary names trial $SUMMARY_BEST, its rule $BEST" >&2; exit 1; }
for name in RUNS_URL ABLATION_URL PARENT_URL; do
  [ -n "${!name}" ] || { echo "no $name in the command's output (see $WORK)" >&2; exit 1; }
done

# Checks: the first chart card is val/loss with a line per run; the parent's metrics table lists the study's
# results; every image of the report has decoded; the dashboard's trial list marks satlab's best trial, and only it.
LOSS_FIRST="document.querySelector('.js-plotly-plot')?.querySelectorAll('.scatterlayer .trace').length >= 2
  && /loss curves[\s\S]*val\/loss[\s\S]*train\/loss/.test(document.body.innerText)"
PARENT_METRICS="/Metrics \\([1-9][0-9]*\\)/.test(document.body.innerText)
  && document.body.innerText.includes('variants/') && document.body.innerText.includes('val_loss_mean')
  && ([...document.querySelectorAll('h1, h2, h3, h4, span')].find(e => /^Metrics \\(/.test(e.textContent))
      ?.scrollIntoView(), true)"  # and show them
REPORT_IMAGES="document.title.startsWith('ablation') && document.images.length >= 2
  && [...document.images].every(i => i.complete && i.naturalWidth > 0)
  && (document.images[0].scrollIntoView(), true)"  # and show the learning curves
BEST_SHOWN="[...document.body.innerText.matchAll(/Trial (\\d+)\\s+Complete\\s+Best Trial/g)].map(m => m[1]).join()
  === '$BEST'"  # in the trial list; the selected trial's own panel repeats its marks after its id
$PY scripts/cdp_screenshot.py \
  "$OUT/runs_comparison.png" "$RUNS_URL" "$LOSS_FIRST" \
  "$OUT/ablation_comparison.png" "$ABLATION_URL" "$LOSS_FIRST" \
  "$OUT/ablation_parent.png" "$PARENT_URL" "$PARENT_METRICS" \
  "$OUT/ablation_report.png" "${PARENT_URL%%\?*}/artifacts/report/report.html?${PARENT_URL#*\?}" "$REPORT_IMAGES" \
  "$OUT/dashboard.png" "http://127.0.0.1:$DASH/dashboard/studies/$STUDY_ID/trials" "$BEST_SHOWN"
echo "best trial: $BEST (satlab and optuna-dashboard); screenshots in $OUT"
