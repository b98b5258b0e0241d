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
BROWSER=""
cleanup() { for pid in $SERVER $BROWSER; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done; rm -rf "$WORK"; }
trap cleanup EXIT

SMALL=(model.n_layers=2 train.max_tokens=65536 train.val_every_tokens=16384 train.log_every_n_steps=1 eval.limit=10
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
CDP=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --user-data-dir="$WORK/chrome" --hide-scrollbars \
  --remote-debugging-port="$CDP" about:blank > "$WORK/chromium.log" 2>&1 &
BROWSER=$!
for _ in $(seq 60); do curl -sf "http://127.0.0.1:$CDP/json/version" >/dev/null && break; sleep 0.5; done
UI="http://127.0.0.1:$PORT/#/experiments/$EXP"
ML="workflowType=machine_learning"  # the UI opens in its GenAI mode on a fresh browser profile
$PY scripts/cdp_screenshot.py --port "$CDP" \
  "$OUT/runs_table.png" "$UI/runs?$ML" \
  "$OUT/run_metrics.png" "$UI/runs/$RUN/model-metrics?$ML" \
  "$OUT/run_system_metrics.png" "$UI/runs/$RUN/system-metrics?$ML" \
  "$OUT/run_overview.png" "$UI/runs/$RUN?$ML"
echo "screenshots in $OUT: runs_table.png run_metrics.png run_system_metrics.png run_overview.png"
