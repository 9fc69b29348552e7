#!/usr/bin/env bash
# Window Pool end to end on the embedded tiny target (issue 19, docs/window_pool.md):
#   1. continued pretraining of the tiny target's routers (recipes/tiny/window_pool.yaml) -> $OUT/wp/final
#   2. held-out perplexity grid, base vs Window Pool (vat profile --perplexity-grid)
#   3. a draft for the Window Pool target: the tiny bench's seed-0 EAGLE-3 draft continued 100 steps with the VAT
#      losses against it (recipes/tiny/eagle3_import_vat.yaml, the same recipe and data as the bench's vat_more cell,
#      which is the base target's draft here)
#   4. speculative decoding under B = none, 8 (E/2), 4 (E/4) for both: tau, expert MiB per token, agreement; both
#      against the base target's natural greedy output (the Window Pool eval runs with --reference-target tiny)
# Usage: bash scripts/window_pool_e2e.sh [OUT=runs/window_pool] [BENCH=runs/bench-tiny] [LIMIT=20]
# Needs the tiny bench's eagle3 and vat_more seed-0 cells (vat bench recipes/bench/tiny_import.yaml seeds=[0]).
set -euo pipefail
OUT=${1:-runs/window_pool}
BENCH=${2:-runs/bench-tiny}
LIMIT=${3:-20}
VAT="${VAT:-vat}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=PASSIVE
mkdir -p "$OUT"
[ -d "$OUT/wp/final" ] || $VAT train recipes/tiny/window_pool.yaml output_dir="$OUT/wp" resume=auto
$VAT profile --perplexity-grid --target tiny --compare-target window_pool="$OUT/wp/final" --limit 64 \
  --windows 4,8,16,32 --pools 4,6,8 --budgets 4,8 --output "$OUT/grid"
[ -d "$OUT/draft_wp/final" ] || $VAT train recipes/tiny/eagle3_import_vat.yaml target.path="$OUT/wp/final" \
  train.init_from="$BENCH/cells/eagle3/seed0/train/final" train.max_steps=100 output_dir="$OUT/draft_wp" resume=auto
EVAL=(--benchmark spec_bench --benchmark humaneval --limit "$LIMIT" --max-new-tokens 64 --steps 7 --budget none,8,4)
$VAT eval --draft "$BENCH/cells/vat_more/seed0/train/final" --target tiny "${EVAL[@]}" --output "$OUT/eval_base"
$VAT eval --draft "$OUT/draft_wp/final" --target "$OUT/wp/final" --reference-target tiny "${EVAL[@]}" \
  --output "$OUT/eval_wp"
python scripts/window_pool_tables.py "$OUT/grid/perplexity_grid.json" "$OUT/eval_base/eval.json" "$OUT/eval_wp/eval.json"
