#!/usr/bin/env bash
# Screenshots of what a user sees in the MLflow UI after two short tiny runs: the runs table of their shared
# experiment and one run's page. Not part of `make test`: it needs Debian's chromium (apt-get install chromium) and
# a few minutes. Usage: scripts/ui_screenshots.sh [OUT_DIR]   (default reports/ui)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-reports/ui}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
command -v chromium >/dev/null || { echo "needs chromium: apt-get install -y chromium" >&2; exit 2; }
WORK=$(mktemp -d)
STORE="sqlite:///$WORK/mlruns/mlflow.db"
mkdir -p "$WORK/mlruns"
SERVER=""
cleanup() { [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT

SMALL=(model.n_layers=2 train.max_tokens=65536 train.val_every_tokens=16384 eval.limit=10
       "train.out_dir=$WORK/runs" "tracking.uri=$STORE")
$PY -c "import mlflow; mlflow.MlflowClient('$STORE').search_experiments()"   # create the store once
for arch in transformer satformer; do
  $PY -m satlab.cli.main train "experiment=tiny/$arch" --no-progress "${SMALL[@]}" > "$WORK/$arch.log" 2>&1
done

PORT=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
$PY -m mlflow server --backend-store-uri "$STORE" --default-artifact-root "$WORK/mlruns/artifacts" \
  --host 127.0.0.1 --port "$PORT" > "$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
read -r EXP RUN < <($PY - "$STORE" <<'PYEOF'
import sys, mlflow
client = mlflow.MlflowClient(sys.argv[1])
experiment = client.get_experiment_by_name("tiny")
run = client.search_runs([experiment.experiment_id], "tags.arch = 'satformer'")[0]
print(experiment.experiment_id, run.info.run_id)
PYEOF
)
shot() {  # url, file
  chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$WORK/chrome" --hide-scrollbars \
    --window-size=1600,1100 --virtual-time-budget=20000 --screenshot="$2" "$1" 2>/dev/null
}
shot "http://127.0.0.1:$PORT/#/experiments/$EXP/runs" "$OUT/runs_table.png"
shot "http://127.0.0.1:$PORT/#/experiments/$EXP/runs/$RUN/model-metrics" "$OUT/run_metrics.png"
shot "http://127.0.0.1:$PORT/#/experiments/$EXP/runs/$RUN" "$OUT/run_overview.png"
echo "screenshots in $OUT: runs_table.png run_metrics.png run_overview.png"
