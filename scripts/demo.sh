#!/usr/bin/env bash
# The main job of the README: sets up .venv on first use, then runs the whole pipeline on the embedded tiny MoE target.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/setup_env.sh
vat demo "$@"
