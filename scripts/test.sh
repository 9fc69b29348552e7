#!/usr/bin/env bash
# The test command of the README: sets up .venv on first use, then runs the fast suite (pytest args pass through).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/setup_env.sh
python -m pytest "$@"
