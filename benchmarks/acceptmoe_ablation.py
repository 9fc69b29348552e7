"""AcceptMoE's ingredients one at a time against MoE-Spec at the same B: KL to natural and union per window.

    python benchmarks/acceptmoe_ablation.py GENERATIONS [--target tiny] [--budget 8] [--window 8]
                                            [--commitment EVAL_JSON] [--limit 20]

GENERATIONS is a ``vat eval`` generations.jsonl with autoregressive rows (draft ``none``): their first turns are the
target's own greedy text. For each prompt the first turn is rendered as served (prompt prefilled naturally) and the
response tiled into windows of ``--window`` positions, as ``vat eval``'s quality figures do. Selections at
|S| = ``--budget``: MoE-Spec (``substitute``); AcceptMoE-fix as the paper defines it (p̂ from ``--commitment``, the
prior 0.8^d without it; natural-top-k demand; root anchor); the same without the anchor, with score demand, with
p̂ = 1; the MoE-Spec reduction (score demand, no anchor); and self-sized AcceptMoE. It prints KL(budgeted ‖ natural)
per token and the mean union per layer per window (docs/verification_policies.md).
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("generations")
    parser.add_argument("--target", default="tiny")
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--commitment", default=None, help="eval.json of the draft (or a JSON list of p̂_d)")
    parser.add_argument("--limit", type=int, default=20)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from vat.eval.benchmarks import load_benchmark
    from vat.eval.commitment import load_commitment
    from vat.eval.prompts import render_chat
    from vat.profile import kl_divergence
    from vat.target import BudgetSpec, load_target, window_union
    from vat.target.budget import AcceptMoESpec

    torch.set_num_threads(1)
    target = load_target(args.target, dtype="float32", device="cpu")
    tok = AutoTokenizer.from_pretrained(target.path)
    p_hat = load_commitment(args.commitment) if args.commitment else ()
    with open(args.generations) as f:
        rows = [json.loads(line) for line in f]
    natural = {r["question_id"]: r["token_ids"][0] for r in rows if r["draft"] == "none"}
    prompts = [p for p in load_benchmark("spec_bench", limit=args.limit) if p.question_id in natural]
    B = args.budget
    variants = {
        "MoE-Spec": ("substitute", B, None),
        "AcceptMoE-fix (paper)": ("acceptmoe", B, AcceptMoESpec(commitment=p_hat)),
        "  without the anchor": ("acceptmoe", B, AcceptMoESpec(commitment=p_hat, anchor=False)),
        "  score demand": ("acceptmoe", B, AcceptMoESpec(commitment=p_hat, demand="score")),
        "  p = 1": ("acceptmoe", B, AcceptMoESpec(commitment=(1.0,))),
        "  score demand, no anchor": ("acceptmoe", B, AcceptMoESpec(commitment=p_hat, demand="score", anchor=False)),
        "AcceptMoE self-sized": ("acceptmoe", "auto", AcceptMoESpec(commitment=p_hat)),
    }
    sums = {name: [0.0, 0, 0.0, 0] for name in variants}
    for p in prompts:
        prompt_ids = render_chat(tok, [{"role": "user", "content": p.turns[0]}])
        start = len(prompt_ids)
        ids = torch.tensor([list(prompt_ids) + natural[p.question_id]])  # (1, P + n)
        reference = target.forward(ids, output_aux=False, capture_routing=False).logits[0, start:]  # (n, V)
        for name, (policy, size, accept) in variants.items():
            spec = BudgetSpec(B=size, policy=policy, window=args.window, offset=start, start_position=start,
                              acceptmoe=accept)
            out = target.forward(ids, budget=spec, output_aux=False)
            kl = kl_divergence(out.logits[0, start:], reference).double()  # (n,)
            union = window_union(out.topk_ids, out.window_groups, out.n_windows, target.num_experts).double()
            s = sums[name]
            s[0] += float(kl.sum())
            s[1] += kl.numel()
            s[2] += float(union.sum())
            s[3] += union.numel()
    print(f"{len(prompts)} prompts, |S| = {B}, windows of {args.window}, p̂ = {list(p_hat) or '0.8^d'}")
    for name, (kl, n, union, m) in sums.items():
        print(f"{name:28s} KL/token {kl / n:.5f}   union/layer/window {union / m:.2f}")


if __name__ == "__main__":
    main()
