"""Budgeted speculative decoding with ``experts_impl=triton`` against ``grouped_mm``: the same tokens, the same rounds.

The path `vat eval --experts-impl triton --budget B` takes, on a random OLMoE target (``tests/tiny_models.py``,
64 experts top-8 like the bench target, or ``--experts/--top-k``) in fp32: the engine decodes the same prompts with
the n-gram draft (its rounds verify real blocks, so the budget cuts every block) and the AR baseline, once per
experts implementation, under each budget of ``--budgets``. A row passes when every prompt's generated tokens and
every round's accepted count are identical. Prompts repeat a random segment, so the n-gram draft gets tokens
accepted and the accept path runs too.

Usage::

    python benchmarks/eval_parity.py --output eval_parity.json --markdown eval_parity.md   # on a GPU
    TRITON_INTERPRET=1 python benchmarks/eval_parity.py --device cpu --prompts 2 --new-tokens 8   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--budgets", nargs="+", type=int, default=[4, 8], help="expert budgets B (natural routing runs too)")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--steps", type=int, default=4, help="n-gram drafts per round (K)")
    p.add_argument("--output", default=None, help="JSON rows")
    p.add_argument("--markdown", default=None, help="Markdown table")
    return p.parse_args(argv)


def prompts(n: int) -> list[list[int]]:
    """Random token prompts that repeat a segment (the n-gram draft then proposes, and some proposals are right)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        seed = torch.randint(3, 128, (4 + i % 3,), generator=gen).tolist()
        out.append(seed * 3)
    return out


def decode_all(impl: str, args, budget: int | None, device) -> list[dict]:
    """Every prompt decoded with the n-gram draft and with AR under ``budget``, with experts implementation ``impl``."""
    import torch
    from tiny_models import tiny_model

    from vat.eval.engine import SpeculativeEngine
    from vat.eval.ngram import NgramSpec
    from vat.target import load_target

    model = tiny_model("olmoe", seed=3, num_experts=args.experts, top_k=args.top_k).to(device=device,
                                                                                    dtype=torch.float32)
    target = load_target(model, device=device, experts_impl=impl)
    try:
        runs = []
        for drafter in (NgramSpec(), None):
            engine = SpeculativeEngine(target, drafter, steps=args.steps, budget=budget,
                                       max_new_tokens=args.new_tokens)
            for prompt in prompts(args.prompts):
                gen = engine.generate(prompt)
                runs.append({"mode": engine.mode, "tokens": gen.token_ids, "accepted": [r.accepted for r in gen.rounds]})
        return runs
    finally:
        target.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for budget in [None, *args.budgets]:
        ref, got = decode_all("grouped_mm", args, budget, device), decode_all("triton", args, budget, device)
        same_tokens = sum(a["tokens"] == b["tokens"] for a, b in zip(ref, got))
        same_rounds = sum(a["accepted"] == b["accepted"] for a, b in zip(ref, got))
        accepted = sum(sum(r["accepted"]) for r in got)
        rows.append({"budget": budget, "runs": len(ref), "identical_tokens": same_tokens,
                     "identical_rounds": same_rounds, "accepted_tokens": accepted,
                     "passed": same_tokens == same_rounds == len(ref)})
        print(f"B={budget}: {same_tokens}/{len(ref)} identical generations, {same_rounds}/{len(ref)} identical rounds, "
              f"{accepted} draft tokens accepted", flush=True)
    record = {"device": str(device), "experts": args.experts, "top_k": args.top_k, "dtype": "float32", "rows": rows}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(record, f, indent=2)
    if args.markdown:
        lines = [f"Budgeted decoding, triton vs grouped_mm ({device}, fp32, {args.experts} experts top-{args.top_k}):",
                 "", "| budget | runs | identical generations | identical rounds | accepted draft tokens | passed |",
                 "|---|---|---|---|---|---|"]
        lines += [f"| {r['budget'] or 'none'} | {r['runs']} | {r['identical_tokens']} | {r['identical_rounds']} | "
                  f"{r['accepted_tokens']} | {'yes' if r['passed'] else 'NO'} |" for r in rows]
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
