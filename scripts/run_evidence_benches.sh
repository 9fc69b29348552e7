#!/usr/bin/env bash
# The evidence runs on the bench target, from their own clone (a bench imports vat lazily between cells, so the tree
# being edited must not be the one it runs), one bench after another; every bench is resumable: rerun to continue.
#   bash scripts/run_evidence_benches.sh [CLONE_DIR]          # default ../bench-clone; results in ./runs/bench-*
# Order: the headline bench (its drafts are read by the budget, ablation and T = 1 benches), its drafts under expert
# budgets, the ablation, T = 1, DFlash, then the 1,000-step saturation curve.
# On 2 cores each bench runs as two single-threaded shards over its seeds (the first also runs the baselines), which
# finishes sooner than one two-threaded process at these sizes; the whole bench is rendered once both are done.
# Nothing else should train meanwhile. VAT_BENCH_SHARDS=1 runs each bench as one two-threaded process instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
work="$PWD/runs"
clone="${1:-../bench-clone}"
if [ -d "$clone/.git" ]; then
  git -C "$clone" pull -q --ff-only "$PWD" main
else
  git clone -q "$PWD" "$clone"
fi
cd "$clone"
# shellcheck disable=SC1091
. scripts/setup_env.sh
export OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled

# the bench's seeds split in two: "0,2,4 1,3" for [0, 1, 2, 3, 4] (one shard when there is one seed)
shard_seeds() {
  python - "$1" <<'PY'
import sys
from vat.bench.config import load_bench_config
seeds = [int(s) for s in load_bench_config(sys.argv[1]).seeds]
print(" ".join(",".join(map(str, part)) for part in (seeds[0::2], seeds[1::2]) if part))
PY
}

for bench in tiny_bench_target tiny_bench_budgets tiny_bench_ablation tiny_bench_t1 tiny_bench_dflash \
             tiny_bench_saturation; do
  config="recipes/bench/$bench.yaml"
  out="$work/bench-${bench//_/-}"
  mkdir -p "$out"
  read -r -a shards <<<"$(shard_seeds "$config")"
  if [ "${VAT_BENCH_SHARDS:-2}" = 1 ] || [ "${#shards[@]}" = 1 ]; then
    echo "[evidence] $(date -u +%H:%M) $bench -> $out"
    python -m vat --threads 2 bench "$config" "output_dir=$out"
    continue
  fi
  echo "[evidence] $(date -u +%H:%M) $bench -> $out (shards: seeds ${shards[0]} | ${shards[1]}, logs in $out)"
  python -m vat --threads 1 bench "$config" "output_dir=$out" "seeds=[${shards[0]}]" >"$out/shard0.log" 2>&1 &
  first=$!
  python -m vat --threads 1 bench "$config" "output_dir=$out" "seeds=[${shards[1]}]" "baselines=[]" \
    >"$out/shard1.log" 2>&1 &
  second=$!
  status=0
  wait "$first" || status=$?
  wait "$second" || status=$?
  [ "$status" = 0 ] || { echo "[evidence] $bench: a shard failed (see $out/shard*.log)"; exit "$status"; }
  python -m vat bench "$config" "output_dir=$out" --render
  # the shards each recorded their own seeds in bench_config.yaml: record the whole bench's
  python -c 'import sys; from omegaconf import OmegaConf; from vat.bench.config import load_bench_config
OmegaConf.save(load_bench_config(sys.argv[1], [f"output_dir={sys.argv[2]}"]), f"{sys.argv[2]}/bench_config.yaml")' \
    "$config" "$out"
done
