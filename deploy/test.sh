#!/usr/bin/env bash
# The test command: set up (idempotent: .venv, Docker, CRIU, sandbox image), lint, run every test.
#   deploy/test.sh [pytest args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash deploy/setup.sh
echo "test: ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check . >/dev/null || { echo "test: ruff format --check failed (run .venv/bin/ruff format .)"; exit 1; }
echo "test: mypy"
.venv/bin/mypy common schemas model services bench
echo "test: pytest"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
before=$(ls /dev/shm 2>/dev/null | grep '^belayer-' | sort || true)
containers() { /usr/bin/docker ps -aq --filter label=belayer.sandbox 2>/dev/null | sort || true; }
cbefore=$(containers)
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
# Leftovers are defects: a test that leaked a process, a container or a /dev/shm file fails the run.
after=$(ls /dev/shm 2>/dev/null | grep '^belayer-' | sort || true)
leaks=$(comm -13 <(echo "$before") <(echo "$after") | grep . || true)
if [ -n "$leaks" ]; then echo "test: shared-memory files left behind: $leaks"; rc=1; fi
cleaks=$(comm -13 <(echo "$cbefore") <(containers) | grep . || true)
if [ -n "$cleaks" ]; then echo "test: sandbox containers left behind: $cleaks"; rc=1; fi
if [ $rc -eq 5 ]; then echo "test: no tests ran"; fi
exit $rc
