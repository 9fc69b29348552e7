#!/usr/bin/env bash
# Window Pool's three arms at three seeds on one tiny target, then one held-out perplexity grid with every arm beside
# the base (issue 33, docs/window_pool.md "Arms"): the seed system (LM + load balancing under the window constraint),
# the pool-mass ablation (+ window_pool.pool_weight=1.0) and the control (the same routers and steps, no constraint).
# Resumable: a finished arm is skipped, a killed one resumes from its checkpoint.
# Usage: bash scripts/window_pool_arms.sh TARGET OUT [SEEDS] [POOLS] [GRID_POOLS] [BUDGETS]
#   tiny       (16 experts top-4): pools 4,8 (the recipe's), grid pools 4,6,8, budgets 4,8
#   tiny-bench (64 experts top-8): bash scripts/window_pool_arms.sh tiny-bench runs/wp-bench "0 1 2" 8,32 8,16,24,32 16,32
#     pools span top_k .. E/2 as the recipe's do for the tiny target
set -euo pipefail
TARGET=${1:?target: tiny | tiny-quick | tiny-bench | a directory}
OUT=${2:?output directory}
SEEDS=${3:-0 1 2}
POOLS=${4:-4,8}
GRID_POOLS=${5:-4,6,8}
BUDGETS=${6:-4,8}
VAT="${VAT:-vat}"
EXTRA="${EXTRA:-}"   # more training overrides for every arm, e.g. EXTRA="train.max_steps=2" for a smoke run
LIMIT="${LIMIT:-64}" # held-out sequences in the grid
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=PASSIVE
mkdir -p "$OUT"
R=recipes/tiny/window_pool.yaml
declare -A ARM=([wp]="" [wp_mass]="window_pool.pool_weight=1.0" [wp_ctl]="window_pool.unconstrained_frac=1.0")
compare=()
for seed in $SEEDS; do
  for arm in wp wp_mass wp_ctl; do
    dir="$OUT/$arm/seed$seed"
    if [ ! -f "$dir/final/window_pool.json" ]; then
      echo "[window pool] $(date -u +%H:%M) $arm seed $seed"
      # shellcheck disable=SC2086
      $VAT train $R target.path="$TARGET" seed="$seed" "window_pool.pools=[${POOLS}]" ${ARM[$arm]} $EXTRA \
        output_dir="$dir" resume=auto > "$OUT/${arm}_seed$seed.log" 2>&1
    fi
    compare+=(--compare-target "${arm}_s$seed=$dir/final")
  done
done
echo "[window pool] $(date -u +%H:%M) perplexity grid"
$VAT profile --perplexity-grid --target "$TARGET" "${compare[@]}" --limit "$LIMIT" --windows 4,8,16,32 \
  --pools "$GRID_POOLS" --budgets "$BUDGETS" --output "$OUT/grid" > "$OUT/grid.log" 2>&1
"${PYTHON:-python}" scripts/window_pool_seeds.py "$OUT/grid/perplexity_grid.json" --output "$OUT/grid/seeds.md" > /dev/null
echo "[window pool] $(date -u +%H:%M) done: $OUT/grid/perplexity_grid.md, $OUT/grid/seeds.md (each arm over seeds)"
