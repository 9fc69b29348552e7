"""Peak memory of DFlash's training loss at a recipe's real readout shape: the full-vocabulary logits materialised
(``loss.imitation_chunk_mb: null``, the autograd reference) against the LM head inside the chunked loss (the default:
the drafter hands the loss :class:`vat.imitation.HeadLogits`).

One run, CPU, one process: for each anchor count the DFlash slots' hidden states (N anchors x K slots x hidden) go
through the recipe's LM-head shape (vocab x hidden, random weights) and the whole objective (the recipe's switches:
soft + hard CE, weight-sum normaliser, adaptive weights, the verification head's BCE; the union term off) forward and backward, and the most bytes
live CPU tensor storages held at once inside that step are recorded (`tests/helpers.py` ``PeakTensorBytes``:
autograd's saved tensors and the backward's buffers included, the inputs not). The target distribution (its
probabilities gathered per block slot when the soft CE is on) is built before the step and not counted: it is the
same for both paths. The line through the two largest anchor counts gives the marginal bytes per anchor; the
recipe's own anchor count is read off it.

    python benchmarks/dflash_loss_memory.py --recipe recipes/qwen3_30b_a3b/dflash_vat.yaml --anchors 4,8,16,32 \\
        --chunk-mb 32 --output runs/dflash_loss_memory
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import replace

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))  # the storage tracker the memory tests use

from helpers import PeakTensorBytes  # noqa: E402

from vat.config import load_config  # noqa: E402
from vat.imitation import HeadLogits, head_logits  # noqa: E402
from vat.losses import LossSwitches, vat_objective  # noqa: E402
from vat.verify import target_dist  # noqa: E402

GIB = 2**30


def step_peak(n_anchors: int, K: int, H: int, V: int, switches: LossSwitches, lazy: bool, seed: int = 0) -> int:
    """Bytes live at once during one objective forward + backward for ``n_anchors`` blocks of K slots."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, H, generator=gen) * H**-0.5  # (V, H) the frozen LM head
    target_logits = torch.randn(1, n_anchors * K, V, generator=gen)  # (1, N*K, V) per block slot
    dist = target_dist(target_logits, with_probs=bool(switches.soft_weight)).apply(
        lambda x: x.reshape(1, n_anchors, K, *x.shape[2:]))  # (1, N, K, ·)
    del target_logits
    valid = torch.ones(1, n_anchors, K, dtype=torch.bool)
    hidden = torch.randn(1, n_anchors, K, H, generator=gen).requires_grad_(True)  # (1, N, K, H)
    vh = torch.randn(1, n_anchors, K, generator=gen).requires_grad_(True) if switches.vh_weight else None
    with PeakTensorBytes() as held:
        logits = HeadLogits(hidden, weight, switches.imitation_chunk_mb) if lazy else head_logits(hidden, weight)
        loss, _ = vat_objective(logits, dist, valid, switches, vh_logits=vh)
        loss.backward()
    return held.peak


def fit(xs: list[int], ys: list[int]) -> tuple[float, float]:
    """The line through the two largest anchor counts, ys ≈ a + b·xs: the marginal bytes per anchor once the batch
    spans several chunks (below one chunk the head-inside path grows like the materialised one)."""
    b = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return ys[-1] - b * xs[-1], b


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=os.path.join(REPO, "recipes", "qwen3_30b_a3b", "dflash_vat.yaml"))
    ap.add_argument("--hidden", type=int, default=2048, help="the target's hidden size (Qwen3-30B-A3B: 2048)")
    ap.add_argument("--vocab", type=int, default=151_936, help="the target's vocabulary (Qwen3: 151,936)")
    ap.add_argument("--anchors", default="4,8,16", help="anchor counts measured (a comma list)")
    ap.add_argument("--chunk-mb", type=float, default=None,
                    help="fp32 MiB per chunk of the head-inside path (default the recipe's loss.imitation_chunk_mb); "
                         "a smaller chunk shows the plateau at fewer anchors")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--output", default=os.path.join(REPO, "runs", "dflash_loss_memory"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.recipe, [])
    K = int(cfg.drafter.block_size) - 1
    base = LossSwitches.from_config(cfg.loss, kind="dflash", block_size=int(cfg.drafter.block_size))
    anchors = [int(a) for a in args.anchors.split(",")]
    rows = []
    for lazy in (False, True):
        chunk_mb = args.chunk_mb or base.imitation_chunk_mb or 256.0
        switches = replace(base, union_weight=0.0, imitation_chunk_mb=chunk_mb if lazy else None)
        peaks = []
        for n in anchors:
            peak = step_peak(n, K, args.hidden, args.vocab, switches, lazy)
            peaks.append(peak)
            print(f"[dflash_loss_memory] {'head inside the loss' if lazy else 'materialised logits'}: "
                  f"{n} anchors -> {peak / GIB:.3f} GiB", flush=True)
        a, b = fit(anchors, peaks)
        recipe_n = int(cfg.drafter.num_anchors)
        rows.append({"path": "head inside the chunked loss" if lazy else "materialised logits (autograd)",
                     "chunk_mb": chunk_mb if lazy else None, "anchors": anchors, "peak_bytes": peaks,
                     "bytes_per_anchor": b, "intercept_bytes": a,
                     "recipe_anchors": recipe_n, "predicted_bytes_at_recipe_anchors": a + b * recipe_n})
    out = {"recipe": os.path.relpath(args.recipe, REPO), "hidden": args.hidden, "vocab": args.vocab, "K": K,
           "switches": {k: v for k, v in dataclasses.asdict(base).items() if isinstance(v, (int, float, str, type(None)))},
           "rows": rows}
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "dflash_loss_memory.json"), "w") as f:
        json.dump(out, f, indent=2)
    lines = [f"# DFlash loss memory at {out['recipe']}'s readout (hidden {args.hidden}, vocab {args.vocab}, K = {K})",
             "", "| path | " + " | ".join(f"{n} anchors (GiB)" for n in anchors)
             + " | MiB per anchor | predicted at the recipe's anchors (GiB) |",
             "|---|" + "---|" * len(anchors) + "---|---|"]
    for r in rows:
        lines.append(f"| {r['path']} | " + " | ".join(f"{p / GIB:.3f}" for p in r["peak_bytes"])
                     + f" | {r['bytes_per_anchor'] / 2**20:.1f} | {r['predicted_bytes_at_recipe_anchors'] / GIB:.2f}"
                     f" ({r['recipe_anchors']}) |")
    with open(os.path.join(args.output, "dflash_loss_memory.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return out


if __name__ == "__main__":
    main()
