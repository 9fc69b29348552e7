#!/usr/bin/env bash
# GPU validation of vat's budgeted Triton experts kernel, on ONE CUDA GPU, offline, <= 6 min on an H200 (each stage has
# its own time limit, so a rerun still fits a 15-minute device window).
#
#   bash scripts/gpu_check.sh [RESULTS_DIR] [--wheels DIR] [--dry-run]
#
# RESULTS_DIR defaults to $OUT, else ./gpu_check_results. Stages (each time-limited; a failing stage does not stop
# the next, the exit status is non-zero if any failed):
#   1. pytest -m gpu on the kernel test files and the training-attention file alone (tests/test_kernel*.py,
#      tests/test_sparse_attention.py: flex_attention's gradients against dense SDPA; another module that fails to import
#      cannot abort them), compiled kernels, -v -rA streamed to the log as results come          -> pytest.log, .xml
#   2. budgeted forwards of all six families, experts_impl triton vs eager: fp32 strict, bf16 reported
#                                                                                               -> parity.json, parity.md
#   3. budgeted speculative decoding, triton vs grouped_mm, fp32, B = 4 and 8 (64 experts top-8): identical
#      generations and rounds (benchmarks/eval_parity.py)                                       -> eval_parity.json, .md
#   4. benchmarks/moe_kernel.py at verification shapes: T 8/32/64, B none/32/16/8, OLMoE and Qwen3-30B-A3B expert
#      dims, bf16: HBM GB/s vs the device's peak, ratio to grouped_mm                          -> moe_kernel.json, .md
# then summary.md (all of it) and env.txt.
#
# Offline: nothing is installed unless --wheels DIR is given (then `pip install --no-index --find-links DIR` of the
# wheels in DIR, e.g. a newer transformers; into the system site, else --user, else a directory under RESULTS_DIR put
# first on PYTHONPATH). vat runs from this checkout: if `import vat.kernels` does not already
# resolve here, a symlinked package tree under RESULTS_DIR/.vat_path maps vat -> vat/ and
# vat.recipes -> recipes/ (pyproject's package-dir) on PYTHONPATH — no pip, no network.
# The Python used is $PYTHON (default: python3); it needs CUDA torch, triton and transformers 5.x.
#
# --dry-run: the same stages on CPU through the Triton interpreter at tiny shapes (seconds; what CI runs): the GPU
# tests are only collected, the parity runs fp32 on two families, the benchmark runs --cpu-smoke.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
RESULTS="" WHEELS="" DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,30p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) RESULTS="$1"; shift ;;
  esac
done
RESULTS="${RESULTS:-${OUT:-$PWD/gpu_check_results}}"
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
# run from RESULTS, never from the checkout's root: there `import vat` would find ./vat first (cwd leads sys.path
# for -c / -m), bypassing the wheels' site and the shim below
cd "$RESULTS"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export PYTHONDONTWRITEBYTECODE=1
# measured on an H200 (docs/bench/gpu_check_h200): tests 115 s, parity > 45 s (compiles), eval 36 s, benchmark 28 s
T_TESTS="${GPU_CHECK_TESTS_S:-150}" T_PARITY="${GPU_CHECK_PARITY_S:-75}" T_EVAL="${GPU_CHECK_EVAL_S:-60}"
T_BENCH="${GPU_CHECK_BENCH_S:-60}"
STATUS=0
log() { echo "[gpu_check $(date +%H:%M:%S)] $*"; }

# ---- environment: local wheels (optional), vat from this checkout ------------------------------------------------
if [ -n "$WHEELS" ]; then
  log "installing the wheels in $WHEELS (--no-index)"
  # the top-level wheels (scripts/gpu_wheels.sh: transformers, omegaconf, datasets), their dependencies from DIR only where the image's
  # own versions do not satisfy them (DIR holds candidates for several Pythons; pip picks the matching one)
  mapfile -t TOP < <(ls "$WHEELS"/transformers-*.whl "$WHEELS"/omegaconf-*.whl "$WHEELS"/datasets-*.whl 2>/dev/null \
    || ls "$WHEELS"/*.whl)
  install() { "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" "$@" "${TOP[@]}"; }
  if ! install && ! install --user; then
    log "system and --user installs failed: installing into $RESULTS/.site (first on PYTHONPATH)"
    install --target "$RESULTS/.site" || { log "wheel install failed"; exit 2; }
    export PYTHONPATH="$RESULTS/.site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
vat_here() { "$PYTHON" - "$REPO" <<'EOF' 2>/dev/null
import os, sys
import vat.kernels
sys.exit(0 if os.path.realpath(vat.kernels.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep) else 1)
EOF
}
if ! vat_here; then
  SHIM="$RESULTS/.vat_path"
  rm -rf "$SHIM" && mkdir -p "$SHIM/vat"
  for entry in "$REPO"/vat/*; do ln -s "$entry" "$SHIM/vat/$(basename "$entry")"; done
  ln -s "$REPO/recipes" "$SHIM/vat/recipes"
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  vat_here || { log "cannot import vat.kernels from $REPO (see $RESULTS/env.txt)"; STATUS=2; }
  log "vat runs from $REPO through $SHIM"
fi
"$PYTHON" - > "$RESULTS/env.txt" 2>&1 <<'EOF'
import platform, torch, triton, transformers
import vat.kernels
print("python", platform.python_version(), "| torch", torch.__version__, "| triton", triton.__version__,
      "| transformers", transformers.__version__)
print("cuda", torch.version.cuda, "| devices", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
print("vat.kernels from", vat.kernels.__file__)
EOF
cat "$RESULTS/env.txt"
[ "$STATUS" -eq 0 ] || exit "$STATUS"
# transformers below vat's lower bound (pyproject) would fail mid-run: 5.17's eager experts one-hot a dropped slot's id
# and crash, and it lacks the _is_expert_parallel flag the budgeted grouped_mm relies on. Refuse in one line, at once.
"$PYTHON" - "$REPO/pyproject.toml" <<'EOF' || exit 2
import re, sys
import transformers
floor = re.search(r'"transformers>=([0-9.]+)', open(sys.argv[1]).read()).group(1)
have = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
if have < tuple(int(x) for x in floor.split(".")[:2]):
    print(f"[gpu_check] transformers {transformers.__version__} is older than vat's lower bound {floor}: on a "
          f"machine with a registry run `pip download 'transformers>={floor}' --no-deps -d wheels/` (plus any "
          f"dependency the image lacks), carry wheels/ here and rerun with --wheels wheels/")
    sys.exit(1)
EOF

run_stage() {  # name, seconds, command...: time-limited, logged, status recorded
  local name="$1" limit="$2"; shift 2
  log "$name (limit ${limit}s)"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$RESULTS/$name.log"
  echo "| $name | $([ $rc -eq 0 ] && echo ok || echo "FAILED (rc $rc$([ $rc -eq 124 ] && echo ', timed out'))") | $((SECONDS - start)) s |" \
    >> "$RESULTS/stages.md"
  [ $rc -eq 0 ] || STATUS=1
}
printf '| stage | result | time |\n|---|---|---|\n' > "$RESULTS/stages.md"

# ---- 1. GPU tests, compiled ---------------------------------------------------------------------------------------
mapfile -t GPU_TESTS < <(grep -l "pytest.mark.gpu" "$REPO"/tests/test_kernel*.py "$REPO"/tests/test_sparse_attention.py)
if [ "$DRY" -eq 1 ]; then
  run_stage pytest "$T_TESTS" env TRITON_INTERPRET=0 "$PYTHON" -m pytest -p no:cacheprovider -o addopts="" \
    --collect-only -q -m gpu "${GPU_TESTS[@]}"
else
  run_stage pytest "$T_TESTS" env TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 "$PYTHON" -m pytest -p no:cacheprovider \
    -p no:logging -o addopts="" -v -rA -m gpu --durations=10 --junitxml="$RESULTS/pytest.xml" "${GPU_TESTS[@]}"
fi

# ---- 2. six families, triton vs eager ------------------------------------------------------------------------------
if [ "$DRY" -eq 1 ]; then
  run_stage parity "$T_PARITY" "$PYTHON" "$REPO"/benchmarks/kernel_parity.py --cpu-smoke --families olmoe gpt_oss \
    --tokens 24 --batch 1 --strict --output "$RESULTS/parity.json" --markdown "$RESULTS/parity.md"
else
  run_stage parity "$T_PARITY" env TRITON_INTERPRET=0 "$PYTHON" "$REPO"/benchmarks/kernel_parity.py --strict \
    --output "$RESULTS/parity.json" --markdown "$RESULTS/parity.md"
fi

# ---- 3. budgeted speculative decoding, triton vs grouped_mm -------------------------------------------------------
if [ "$DRY" -eq 1 ]; then
  run_stage eval_parity "$T_EVAL" env TRITON_INTERPRET=1 "$PYTHON" "$REPO"/benchmarks/eval_parity.py --device cpu \
    --prompts 1 --new-tokens 6 --budgets 4 --experts 16 --top-k 4 \
    --output "$RESULTS/eval_parity.json" --markdown "$RESULTS/eval_parity.md"
else
  run_stage eval_parity "$T_EVAL" env TRITON_INTERPRET=0 "$PYTHON" "$REPO"/benchmarks/eval_parity.py \
    --output "$RESULTS/eval_parity.json" --markdown "$RESULTS/eval_parity.md"
fi

# ---- 4. kernel benchmark at verification shapes --------------------------------------------------------------------
if [ "$DRY" -eq 1 ]; then
  run_stage moe_kernel "$T_BENCH" "$PYTHON" "$REPO"/benchmarks/moe_kernel.py --cpu-smoke \
    --output "$RESULTS/moe_kernel.json" --markdown "$RESULTS/moe_kernel.md"
else
  run_stage moe_kernel "$T_BENCH" env TRITON_INTERPRET=0 "$PYTHON" "$REPO"/benchmarks/moe_kernel.py --tokens 8 32 64 \
    --budgets none 32 16 8 --dtype bfloat16 --warmup 5 --iters 30 \
    --output "$RESULTS/moe_kernel.json" --markdown "$RESULTS/moe_kernel.md"
fi

# ---- summary -------------------------------------------------------------------------------------------------------
{
  echo "# vat GPU check$([ "$DRY" -eq 1 ] && echo ' (dry run: CPU, Triton interpreter)')"
  echo
  echo '```'; cat "$RESULTS/env.txt"; echo '```'
  echo
  cat "$RESULTS/stages.md"
  echo
  echo "## GPU tests"
  echo '```'; grep -E "passed|failed|error|skipped|collected|tests? (collected|selected)" "$RESULTS/pytest.log" | tail -n 5; echo '```'
  for part in parity eval_parity moe_kernel; do
    echo
    if [ -s "$RESULTS/$part.md" ]; then cat "$RESULTS/$part.md"; else echo "($part: no table — see $part.log)"; fi
  done
} > "$RESULTS/summary.md"
log "summary: $RESULTS/summary.md (status $STATUS)"
exit "$STATUS"
