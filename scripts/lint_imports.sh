#!/usr/bin/env bash
# Checks vat's import layers (the contract in pyproject.toml, [tool.importlinter]) with import-linter.
#   bash scripts/lint_imports.sh          # exit 0: every contract kept
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PYTHON:-$PWD/.venv/bin/python}"
"$py" -c "import importlinter" 2>/dev/null || "$py" -m pip install -q "import-linter>=2.1"
PYTHONPATH="$PWD" "$(dirname "$py")/lint-imports" --no-cache
