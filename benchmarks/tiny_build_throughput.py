"""Pretraining throughput of candidate tiny-target sizes side by side, and the tokens each can train in a budget.

    python benchmarks/tiny_build_throughput.py                       # the bench spec and a few variants, 8 steps each
    python benchmarks/tiny_build_throughput.py --steps 16 --hours 2.5 --output runs/build_throughput

Every candidate is the bench spec with some fields replaced (``--candidates`` names them from :data:`CANDIDATES`),
built with the bench build's own code (tokenizer trained on the bench data mix, ``build_model``, AdamW + the load-
balancing loss of ``pretrain``) and timed over ``--steps`` optimizer steps after 2 warm-up steps, on the same packed
rows, one candidate after the other in one process with the build's 2 deterministic threads. Reported per candidate:
parameters (total / active per token), seconds per step, training tokens/s, and the tokens a build of ``--hours``
can train after ``--overhead`` of it goes to reading data, the tokenizer and evaluation. JSON + Markdown to
``--output``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, replace

import torch

from vat.data_prep import tiny_target as tt
from vat.data_prep.tiny_pretrain import param_groups

CANDIDATES = {
    "bench": {},
    "bench-h192": {"hidden_size": 192},
    "bench-h320": {"hidden_size": 320},
    "bench-6-layers": {"num_hidden_layers": 6},
    "bench-ffn96": {"intermediate_size": 96},
}


def time_candidate(spec, tokenizer, rows: torch.Tensor, steps: int) -> dict:
    """Seconds per optimizer step of ``spec``'s model on ``rows`` (2 warm-up steps, then ``steps`` timed)."""
    torch.manual_seed(0)
    model = tt.build_model(spec, tokenizer).train()
    opt = torch.optim.AdamW(param_groups(model, spec.weight_decay), lr=spec.lr, betas=(0.9, 0.95))
    batch = spec.batch_size
    seconds = []
    for step in range(steps + 2):
        x = rows[(step * batch) % (rows.shape[0] - batch):][:batch]  # (B, T)
        start = time.perf_counter()
        out = model(input_ids=x, labels=x, output_router_logits=True, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= 2:
            seconds.append(time.perf_counter() - start)
    per_step = sorted(seconds)[len(seconds) // 2]  # median
    params = tt.count_parameters(model)
    return {"parameters": params["total"], "active_per_token": params["active_per_token"],
            "seconds_per_step": per_step, "tokens_per_second": batch * rows.shape[1] / per_step}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help="names from CANDIDATES, comma-separated")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per candidate")
    parser.add_argument("--hours", type=float, default=2.5, help="the build's time budget")
    parser.add_argument("--overhead", type=float, default=0.12, help="share of the budget not spent training")
    parser.add_argument("--output", default="runs/build_throughput")
    args = parser.parse_args()

    base = replace(tt.BENCH_SPEC, train_tokens=400_000)  # enough text for the tokenizer and the timed rows
    train, _, stats = tt.read_training_chats(base)
    tokenizer = tt.train_tokenizer((m["content"] for conv in train for m in conv), base.vocab_size,
                                   base.max_position_embeddings)
    rows = tt.pack_conversations(tokenizer, train, base)  # (N, T)
    results = {}
    with tt.deterministic_cpu():
        for name in args.candidates.split(","):
            spec = replace(base, **CANDIDATES[name])
            r = time_candidate(spec, tokenizer, rows, args.steps)
            r["tokens_in_budget"] = int(r["tokens_per_second"] * args.hours * 3600 * (1 - args.overhead))
            r["spec"] = {k: v for k, v in asdict(spec).items() if k in CANDIDATES[name] or k in (
                "hidden_size", "num_hidden_layers", "intermediate_size", "num_experts", "num_experts_per_tok")}
            results[name] = r
            print(f"{name}: {r['parameters'] / 1e6:.1f} M parameters ({r['active_per_token'] / 1e6:.1f} M active), "
                  f"{r['seconds_per_step']:.2f} s/step, {r['tokens_per_second']:.0f} tokens/s, "
                  f"{r['tokens_in_budget'] / 1e6:.1f} M tokens in {args.hours} h", flush=True)
    os.makedirs(args.output, exist_ok=True)
    record = {"hours": args.hours, "overhead": args.overhead, "steps": args.steps, "rows": list(rows.shape),
              "threads": tt.NUM_THREADS, "data": {"code": stats.get("code", {}).get("python")}, "results": results}
    with open(os.path.join(args.output, "build_throughput.json"), "w") as f:
        json.dump(record, f, indent=2)
    lines = ["| candidate | parameters (active) | s / step | tokens / s | tokens in budget |", "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['parameters'] / 1e6:.1f} M ({r['active_per_token'] / 1e6:.1f} M) | "
                     f"{r['seconds_per_step']:.2f} | {r['tokens_per_second']:.0f} | {r['tokens_in_budget'] / 1e6:.1f} M |")
    with open(os.path.join(args.output, "build_throughput.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
