"""Seconds of a drafter's training forward + backward with dense vs blockwise attention, side by side in one process.

    python benchmarks/training_attention.py [--shapes tiny,qwen3] [--tokens 256,512,1024] [--repeats 3] \
        [--output runs/training_attention]

Per shape and token count: the EAGLE-3 TTT unroll (K = 7) and the DFlash block forward (block 16, one anchor per
16 positions) of a randomly initialised draft at that shape, forward and backward through its logits, with
``attention="dense"`` (one SDPA call over the concatenated keys, a dense mask) and ``attention="blockwise"``
(:mod:`vat.drafters.sparse_attention`), timed round-robin so machine noise hits both alike; medians and the ratio
dense / blockwise are printed and written to ``<output>.json`` / ``.md``. The LM head is the recipe's (draft vocab
32,000 for the Qwen3-30B-A3B EAGLE-3 recipe; DFlash reads the target's vocab, cut to 32,000 here so the CPU cell
fits): the ratio is the draft's step, not attention alone. Shapes:

* ``tiny``: the tiny recipes' drafts (hidden 192, 4 heads / 2 KV heads, vocab 8,192).
* ``qwen3``: Qwen3-30B-A3B's recipes (hidden 2,048, 32 heads / 4 KV heads of 128, aux width 3 x 2,048; DFlash 5
  layers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from vat.drafters.dflash import DFlashConfig, DFlashDrafter
from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter

SHAPES = {
    "tiny": dict(hidden=192, inter=512, heads=4, kv=2, head_dim=48, vocab=8192, draft_vocab=8192, dflash_layers=1),
    "qwen3": dict(hidden=2048, inter=6144, heads=32, kv=4, head_dim=128, vocab=32000, draft_vocab=32000,
                  dflash_layers=5),
}
IMPLS = ("dense", "blockwise")


def eagle3_case(s: dict, tokens: int):
    """A closure running one EAGLE-3 TTT forward + backward at ``tokens`` positions (K = 7)."""
    cfg = Eagle3Config(hidden_size=s["hidden"], intermediate_size=s["inter"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["kv"], head_dim=s["head_dim"], vocab_size=s["vocab"],
                       draft_vocab_size=s["draft_vocab"], num_target_layers=8, ttt_steps=7)
    g = torch.Generator().manual_seed(0)
    draft = Eagle3Drafter(cfg, torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02)
    aux = torch.randn(1, tokens, 3 * s["hidden"], generator=g)
    ids = torch.randint(0, s["vocab"], (1, tokens), generator=g)

    def run(impl: str) -> None:
        out = draft.ttt_forward(aux, ids, attention=impl)
        out.logits.float().logsumexp(-1).mean().backward()
        draft.zero_grad(set_to_none=True)

    return run


def dflash_case(s: dict, tokens: int):
    """A closure running one DFlash block forward + backward: block 16, tokens / 16 anchors."""
    cfg = DFlashConfig(hidden_size=s["hidden"], intermediate_size=s["inter"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["kv"], head_dim=s["head_dim"], num_hidden_layers=s["dflash_layers"],
                       vocab_size=s["vocab"], num_target_layers=8, block_size=16, mask_token_id=1)
    g = torch.Generator().manual_seed(0)
    draft = DFlashDrafter(cfg, torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02,
                          torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02)
    aux = torch.randn(1, tokens, len(cfg.target_layer_ids) * s["hidden"], generator=g)
    ids = torch.randint(2, s["vocab"], (1, tokens), generator=g)
    anchors = torch.arange(1, tokens - 16, 16)[None, :]  # (1, N)

    def run(impl: str) -> None:
        out = draft(aux, ids, anchors, attention=impl)
        out.logits.float().logsumexp(-1).mean().backward()
        draft.zero_grad(set_to_none=True)

    return run


def time_pair(run, repeats: int) -> dict:
    """Round-robin medians of ``run(impl)`` per implementation (one warm-up each first)."""
    times = {impl: [] for impl in IMPLS}
    for impl in IMPLS:
        run(impl)
    for _ in range(repeats):
        for impl in IMPLS:
            start = time.perf_counter()
            run(impl)
            times[impl].append(time.perf_counter() - start)
    row = {impl: statistics.median(ts) for impl, ts in times.items()}
    row["ratio"] = row["dense"] / row["blockwise"]
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | drafter | tokens | dense s | blockwise s | dense / blockwise |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['drafter']} | {r['tokens']} | {r['dense']:.3f} | {r['blockwise']:.3f} | "
                     f"{r['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="tiny,qwen3")
    p.add_argument("--tokens", default="256,512,1024")
    p.add_argument("--drafters", default="eagle3,dflash")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default="runs/training_attention")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = {"eagle3": eagle3_case, "dflash": dflash_case}
    rows = []
    for shape in args.shapes.split(","):
        for drafter in args.drafters.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                row = {"shape": shape, "drafter": drafter, "tokens": tokens,
                       **time_pair(cases[drafter](SHAPES[shape], tokens), args.repeats)}
                rows.append(row)
                print(f"{shape} {drafter} {tokens}: dense {row['dense']:.3f} s, blockwise {row['blockwise']:.3f} s, "
                      f"ratio {row['ratio']:.2f}", flush=True)
                os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
                with open(args.output + ".json", "w") as f:
                    json.dump({"threads": args.threads, "repeats": args.repeats, "rows": rows}, f, indent=1)
                with open(args.output + ".md", "w") as f:
                    f.write(markdown(rows))


if __name__ == "__main__":
    main()
