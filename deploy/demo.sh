#!/usr/bin/env bash
# The main job, on CPU: set up if needed (.venv, Docker, CRIU, the sandbox images), warm-start
# the tiny SWE model (trained once, then cached), then a real agentic GRPO run — `belayer run
# swe`: rollout → reward → GRPO update → weights pushed → next rollout on the new weights —
# with a rollout worker, a sandbox and the trainer SIGKILLed along the way. Ends with the
# per-step table and where the report and plots are.
#   deploy/demo.sh [extra `belayer run` options, e.g. --steps 5]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash deploy/setup.sh
export BELAYER_HOME="${BELAYER_HOME:-$ROOT/.belayer/demo}"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
B=.venv/bin/belayer
$B down >/dev/null 2>&1 || true  # a node left in this run dir by an earlier demo
OUT="$BELAYER_HOME/runs/swe-demo-$(date +%Y%m%d-%H%M%S)"
$B run swe --steps 3 --out "$OUT" \
  --inject worker-kill@step=1,sandbox-kill@step=1,trainer-kill@step=2 "$@"
