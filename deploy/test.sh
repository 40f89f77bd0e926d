#!/usr/bin/env bash
# The test command: set up (idempotent: .venv, Docker, CRIU, sandbox image), lint, run every test.
#   deploy/test.sh [pytest args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# The warm-started tiny models the rollout tests use (tests/model_fixtures.py), made before the
# tests that use them so no test's timeout pays for a training: cached in $BELAYER_CACHE_DIR
# (default ~/.cache/belayer) by a key of their inputs, so only a machine's first run trains. The
# math one (~13 minutes on one thread, no sandbox) starts as soon as the .venv exists and trains
# beside the Docker/CRIU install, the lint, the swe warm start (~17 minutes on a quiet machine:
# 6 recording its 352 sandbox episodes, 11 training; it starts once Docker is up, beside the
# lint, and the tests wait for it) and the chaos and unit tests (none of which uses the math
# one); the integration tests wait for it.
BELAYER_SKIP_ENV=1 bash deploy/setup.sh
WARM=$(mktemp -d /tmp/belayer-warm.XXXXXX)
warm() {  # warm KIND [NICE]: the warm start in the background (its pid in WARM_PID)
  nice -n "${2:-0}" .venv/bin/belayer model init --tiny --warm-start "$1" "$WARM/$1" > "$WARM/$1.log" 2>&1 &
  WARM_PID=$!
}
warm_done() {  # warm_done KIND PID: wait for it; its log; fail the run if it failed
  local rc=0
  wait "$2" || rc=$?
  cat "$WARM/$1.log"
  if [ $rc -ne 0 ]; then echo "test: the $1 warm start failed (above)"; exit 1; fi
}
echo "test: warm-started models (math in the background)"
warm math 19; MATH_PID=$WARM_PID  # the CPU the tests leave: they are timed (chaos), it is not
trap 'kill $MATH_PID 2>/dev/null || true; rm -rf "$WARM"' EXIT
bash deploy/install_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
echo "test: the swe warm start (in the background while ruff and mypy run; it needs docker)"
warm swe; SWE_PID=$WARM_PID
trap 'kill $MATH_PID $SWE_PID 2>/dev/null || true; rm -rf "$WARM"' EXIT
echo "test: ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check . >/dev/null || { echo "test: ruff format --check failed (run .venv/bin/ruff format .)"; exit 1; }
echo "test: mypy"
.venv/bin/mypy common schemas model workloads services belayer bench tests
warm_done swe $SWE_PID
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
pytest_in() {  # pytest_in DIR ARGS...: one session with its own run directories under $BASETEMP
  local dir=$1; shift
  .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 --basetemp "$BASETEMP/$dir" "$@"
}
set +e
if [ $# -gt 0 ]; then  # the tests asked for, once both models exist
  warm_done math $MATH_PID
  echo "test: pytest $*"
  pytest_in all "$@"
  rc=$?
else
  echo "test: pytest tests/chaos tests/unit (beside the math warm start)"
  pytest_in first tests/chaos tests/unit
  rc=$?
  echo "test: waiting for the math warm start"
  warm_done math $MATH_PID
  echo "test: pytest tests/integration"
  pytest_in integration tests/integration
  rc2=$?
  [ $rc -ne 0 ] || rc=$rc2
fi
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
