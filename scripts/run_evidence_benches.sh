#!/usr/bin/env bash
# The evidence runs on the bench target, from their own clone (a bench imports vat lazily between cells, so the tree
# being edited must not be the one it runs), one bench after another; every bench is resumable: rerun to continue.
#   bash scripts/run_evidence_benches.sh [CLONE_DIR]          # default ../bench-clone; results in ./runs/bench-*
# Order: the headline bench (its drafts are read by the ablation and T = 1 benches), the ablation, T = 1, DFlash,
# then the 1,000-step saturation curve. One heavy job at a time on 2 cores: nothing else should train meanwhile.
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
for bench in tiny_bench_target tiny_bench_ablation tiny_bench_t1 tiny_bench_dflash tiny_bench_saturation; do
  out="$work/bench-${bench//_/-}"
  echo "[evidence] $(date -u +%H:%M) $bench -> $out"
  python -m vat --threads 2 bench "recipes/bench/$bench.yaml" "output_dir=$out"
done
