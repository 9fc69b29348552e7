#!/usr/bin/env bash
# Window Pool's arms at three seeds on one tiny target, then one held-out perplexity grid with every arm beside
# the base (issue 33, docs/window_pool.md "Arms"): the seed system (LM + load balancing under the window constraint),
# the pool-mass ablation (+ window_pool.pool_weight=1.0) and the control (the same routers and steps, no constraint);
# with ARMS="wp_doc wp_from_doc", the document-pool base (one pool per packed row: window_pool.windows=null, pools
# DOC_POOLS) and Window Pool trained from it (the seed's starting point).
# Resumable: a finished arm is skipped, a killed one resumes from its checkpoint.
# Usage: bash scripts/window_pool_arms.sh TARGET OUT [SEEDS] [POOLS] [GRID_POOLS] [BUDGETS]
#   tiny       (16 experts top-4): pools 4,8 (the recipe's), grid pools 4,6,8, budgets 4,8
#   tiny-bench (64 experts top-8): bash scripts/window_pool_arms.sh tiny-bench runs/wp-bench "0 1 2" 8,32 8,16,24,32 16,32
#     pools span top_k .. E/2 as the recipe's do for the tiny target; then the document-pool arms in a second grid:
#     ARMS="wp_doc wp_from_doc" DOC_POOLS=16,32 GRID=runs/wp-bench/grid_doc bash scripts/window_pool_arms.sh tiny-bench \
#       runs/wp-bench "0 1 2" 8,32 8,16,24,32 16,32
#     python scripts/window_pool_seeds.py runs/wp-bench/grid/perplexity_grid.json \
#       runs/wp-bench/grid_doc/perplexity_grid.json --versus wp_ctl
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
ARMS="${ARMS:-wp wp_mass wp_ctl}"
DOC_POOLS="${DOC_POOLS:-$POOLS}"  # d_w of the document-pool base (a whole 512-token row shares one pool)
GRID="${GRID:-$OUT/grid}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=PASSIVE
mkdir -p "$OUT"
R=recipes/tiny/window_pool.yaml
declare -A ARM=([wp]="window_pool.pools=[${POOLS}]" [wp_mass]="window_pool.pools=[${POOLS}] window_pool.pool_weight=1.0"
                [wp_ctl]="window_pool.pools=[${POOLS}] window_pool.unconstrained_frac=1.0"
                [wp_doc]="window_pool.pools=[${DOC_POOLS}] window_pool.windows=null"
                [wp_from_doc]="window_pool.pools=[${POOLS}]")
compare=()
for seed in $SEEDS; do
  for arm in $ARMS; do
    [ -n "${ARM[$arm]+x}" ] || { echo "unknown arm $arm (wp wp_mass wp_ctl wp_doc wp_from_doc)" >&2; exit 2; }
    dir="$OUT/$arm/seed$seed"
    target="$TARGET"
    [ "$arm" = wp_from_doc ] && target="$OUT/wp_doc/seed$seed/final"  # trained after wp_doc of the same seed
    if [ ! -f "$dir/final/window_pool.json" ]; then
      echo "[window pool] $(date -u +%H:%M) $arm seed $seed"
      # shellcheck disable=SC2086
      $VAT train $R target.path="$target" seed="$seed" ${ARM[$arm]} $EXTRA output_dir="$dir" resume=auto \
        > "$OUT/${arm}_seed$seed.log" 2>&1
    fi
    compare+=(--compare-target "${arm}_s$seed=$dir/final")
  done
done
echo "[window pool] $(date -u +%H:%M) perplexity grid"
$VAT profile --perplexity-grid --target "$TARGET" "${compare[@]}" --limit "$LIMIT" --windows 4,8,16,32 \
  --pools "$GRID_POOLS" --budgets "$BUDGETS" --output "$GRID" > "$GRID.log" 2>&1
"${PYTHON:-python}" scripts/window_pool_seeds.py "$GRID/perplexity_grid.json" --output "$GRID/seeds.md" > /dev/null
echo "[window pool] $(date -u +%H:%M) done: $GRID/perplexity_grid.md, $GRID/seeds.md (each arm over seeds)"
