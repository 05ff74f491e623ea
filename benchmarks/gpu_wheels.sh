#!/usr/bin/env bash
# Fetch, here, the wheels a GPU machine lacks into .whl/ (ignored by git), for
# benchmarks/gpu_session.sh to install there: the GPU image has torch 2.11 for Python 3.12 and
# no package index. torchao gives the torchao float8 recipes and the float8 grouped experts.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"
}
get torchao==0.18.0
ls -la .whl
