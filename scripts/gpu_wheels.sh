#!/usr/bin/env bash
# Wheels that let scripts/gpu_check.sh run on a GPU image whose transformers is older than vat's lower bound (5.17 is
# common) and which has no package registry. Run on a machine WITH a registry, then carry DIR to the GPU machine:
#
#   bash scripts/gpu_wheels.sh [DIR]          # default DIR: wheels/ (git-ignored)
#   bash scripts/gpu_check.sh RESULTS --wheels wheels/
#
# DIR gets transformers at vat's lower bound (pyproject), omegaconf and datasets (vat's config and data modules, which
# the kernel tests and the parity benchmarks import; CUDA images often lack both) and the wheels of their dependencies
# that older images may lack in a new enough version, for CPython 3.10-3.13 on x86_64 (about 40 MB): pip on the GPU
# machine installs only what its own packages do not already satisfy.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DIR="${1:-wheels}"
PYTHON="${PYTHON:-python3}"
FLOOR="$(sed -n 's/.*"transformers>=\([0-9.]*\).*/\1/p' pyproject.toml | head -1)"
mkdir -p "$DIR"
"$PYTHON" -m pip download --no-deps -d "$DIR" "transformers==$FLOOR" 'omegaconf>=2.4' 'datasets>=3.0' 'dill'
for py in 3.10 3.11 3.12 3.13; do
  "$PYTHON" -m pip download --only-binary=:all: --python-version "$py" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --no-deps -d "$DIR" \
    'huggingface-hub>=1.31,<3' 'tokenizers>=0.23.1,<0.24' 'safetensors>=0.8' 'regex>=2025.10.22' typer \
    'hf-xet' 'httpx' 'shellingham' 'rich' 'click' \
    'multiprocess' 'pyyaml' 'xxhash' >/dev/null
done
ls -1 "$DIR"
du -sh "$DIR"
