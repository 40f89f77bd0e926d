#!/usr/bin/env bash
# The main job: set up if needed, start a Belayer node, run a batch of generation requests while
# failures are injected (a rollout worker is SIGKILLed mid-generation), show recovery, stop.
#   deploy/demo.sh [--engines N] [--requests N]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BELAYER_SKIP_ENV="${BELAYER_SKIP_ENV:-1}" bash deploy/setup.sh
export BELAYER_HOME="${BELAYER_HOME:-$ROOT/.belayer/demo}"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
B=.venv/bin/belayer
$B down >/dev/null 2>&1 || true
trap '$B down' EXIT
$B up --detach --engines 2
.venv/bin/python deploy/demo_requests.py "$@"
$B status
