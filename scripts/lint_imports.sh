#!/usr/bin/env bash
# Checks vat's import layers (the contract in pyproject.toml, [tool.importlinter]) with import-linter.
#   bash scripts/lint_imports.sh          # exit 0: every contract kept
# kernels/ and data_prep/ install as vat.kernels and vat.data_prep (pyproject's package-dir), which import-linter,
# reading the vat/ folder, would not see: it reads a link farm laid out as the installed package.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo="$PWD"
py="${PYTHON:-$repo/.venv/bin/python}"
"$py" -c "import importlinter" 2>/dev/null || "$py" -m pip install -q "import-linter>=2.1"
farm="$(mktemp -d)"
trap 'rm -rf "$farm"' EXIT
mkdir "$farm/vat"
for entry in "$repo"/vat/*; do ln -s "$entry" "$farm/vat/"; done
ln -s "$repo/kernels" "$farm/vat/kernels"
ln -s "$repo/data_prep" "$farm/vat/data_prep"
cd "$farm"
PYTHONPATH="$farm" "$(dirname "$py")/lint-imports" --no-cache "$repo/pyproject.toml"
