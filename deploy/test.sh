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
.venv/bin/mypy common schemas model workloads services belayer bench tests
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# The warm-started tiny models the rollout tests use (tests/model_fixtures.py), made before the
# tests so no test's timeout pays for a training: cached in $BELAYER_CACHE_DIR (default
# ~/.cache/belayer) by a key of their inputs, so only a machine's first run trains (math ~13
# minutes on one thread, swe ~5 with its sandbox recordings: side by side, one core each).
echo "test: warm-started models"
WARM=$(mktemp -d /tmp/belayer-warm.XXXXXX)
pids=()
for kind in math swe; do
  .venv/bin/belayer model init --tiny --warm-start "$kind" "$WARM/$kind" > "$WARM/$kind.log" 2>&1 &
  pids+=($!)
done
wrc=0
for i in 0 1; do wait "${pids[$i]}" || wrc=1; done
cat "$WARM/math.log" "$WARM/swe.log"
rm -rf "$WARM"
if [ $wrc -ne 0 ]; then echo "test: a warm start failed (above)"; exit 1; fi
echo "test: pytest"
before=$(ls /dev/shm 2>/dev/null | grep '^belayer-' | sort || true)
containers() { /usr/bin/docker ps -aq --filter label=belayer.sandbox 2>/dev/null | sort || true; }
cbefore=$(containers)
# Every test's run directories live under one temp dir, so what a test leaves is findable.
BASETEMP=$(mktemp -d /tmp/belayer-test.XXXXXX)
# "pid args" of live processes a Belayer supervisor started (BELAYER_RUN_ID in their environment,
# inherited by what they start) or running from a test's temp dir.
runprocs() {
  local e p
  for e in /proc/[0-9]*/environ; do
    p=${e#/proc/}; p=${p%/environ}
    { grep -qa 'BELAYER_RUN_ID=' "$e" || grep -qaF "$BASETEMP" "/proc/$p/cmdline"; } 2>/dev/null || continue
    [ "$(sed 's/.*) //' "/proc/$p/stat" 2>/dev/null | cut -c1)" = Z ] && continue
    echo "$p $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-200)"
  done | sort -k1,1 || true
}
pbefore=$(runprocs)
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 --basetemp "$BASETEMP" "$@"
rc=$?
set -e
# Leftovers are defects: a test that leaked a process, a container, a /dev/shm file or a sandbox
# checkpoint directory fails the run.
after=$(ls /dev/shm 2>/dev/null | grep '^belayer-' | sort || true)
leaks=$(comm -13 <(echo "$before") <(echo "$after") | grep . || true)
if [ -n "$leaks" ]; then echo "test: shared-memory files left behind: $leaks"; rc=1; fi
cleaks=$(comm -13 <(echo "$cbefore") <(containers) | grep . || true)
if [ -n "$cleaks" ]; then echo "test: sandbox containers left behind: $cleaks"; rc=1; fi
pleaks=$(join -v2 <(echo "$pbefore" | cut -d' ' -f1) <(runprocs) | grep . || true)
if [ -n "$pleaks" ]; then echo "test: processes left behind:"; echo "$pleaks"; rc=1; fi
ckleaks=$(find "$BASETEMP" -path '*/env/checkpoints/*' -prune 2>/dev/null | grep . || true)
if [ -n "$ckleaks" ]; then echo "test: sandbox checkpoint dirs left behind: $ckleaks"; rc=1; fi
if [ $rc -eq 0 ]; then rm -rf "$BASETEMP"; else echo "test: test run directories kept in $BASETEMP"; fi
if [ $rc -eq 5 ]; then echo "test: no tests ran"; fi
exit $rc
