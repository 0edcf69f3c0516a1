#!/usr/bin/env bash
# Run HERE (a machine with network), before tests/gpu/check.sh runs on a GPU machine without one: puts the wheels nxdt
# needs beyond that machine's image (PyTorch, Lightning, transformers, NumPy, PyYAML, rich... are there; Hydra and
# OmegaConf are not) into a folder git ignores, for check.sh to install with --no-index.
#   tests/gpu/prepare.sh [WHEEL_DIR]        (default tests/gpu/wheels; carry it to the GPU machine with the tree)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-tests/gpu/wheels}
mkdir -p "$out"
# pure-Python wheels, any interpreter (the GPU image runs Python 3.12); versions as this repository's venv resolves them
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform any --dest "$out" hydra-core==1.3.8 omegaconf==2.3.1
# antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 pins) is published as a source archive only: build its wheel here
python3 -m pip wheel --quiet --no-deps --wheel-dir "$out" antlr4-python3-runtime==4.9.3
ls -l "$out"
