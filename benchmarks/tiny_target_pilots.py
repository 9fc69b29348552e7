"""Compute-matched pilot builds of bench-target candidates, judged on held-out text: how the size and mix were chosen.

    python benchmarks/tiny_target_pilots.py --seconds 420                   # 3 candidates, 420 s of training each
    python benchmarks/tiny_target_pilots.py --seconds 300 --candidates bench,bench-h192 --output runs/pilots

Every candidate is the bench spec with some fields replaced (:data:`PILOTS`). All share one tokenizer (trained on the
bench mix, so perplexities compare) and the same held-out chat and code conversations. Each is timed for a few steps
(``tiny_build_throughput.time_candidate``), given the tokens it trains in ``--seconds`` at that rate, and pretrained
with the build's own ``pretrain`` (full warmup + cosine over those tokens): the same compute for every candidate, so
a bigger model trains fewer tokens. Reported per candidate: tokens trained, held-out perplexity (chat, chat assistant
tokens, code) and the target-quality row (``vat.eval.target_quality``) on ``--prompts`` Spec-Bench and HumanEval
prompts. Written as they finish (a killed run keeps the finished candidates and skips them when rerun): JSON +
Markdown in ``--output``.

Short pilots favour small models (they are further from their plateau); the report says so beside the choice.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace

import torch
from tiny_build_throughput import time_candidate

from vat.data_prep import tiny_target as tt
from vat.data_prep.code_chats import CODE_INSTRUCTION
from vat.data_prep.tiny_pretrain import pretrain
from vat.eval.target_quality import write_quality

PILOTS = {
    "bench": {},
    "bench-h192": {"hidden_size": 192},
    "bench-code0.15": {"code_fraction": 0.15},
    "bench-6-layers": {"num_hidden_layers": 6},
    "bench-batch4": {"batch_size": 4},
}
CODE_PREFIX = CODE_INSTRUCTION.split("{")[0]


def is_code_chat(conv: list[dict]) -> bool:
    """Whether ``conv`` is one of the standard-library code chats (not a ShareGPT conversation)."""
    return conv[0]["role"] == "user" and conv[0]["content"].startswith(CODE_PREFIX)


def with_code_fraction(train: list[list[dict]], fraction: float, base_fraction: float) -> list[list[dict]]:
    """``train`` with its code chats thinned (every k-th kept) from ``base_fraction`` of the text to ``fraction``."""
    if fraction >= base_fraction:
        return train
    chats = [c for c in train if not is_code_chat(c)]
    code = [c for c in train if is_code_chat(c)]
    keep = fraction * (1 - base_fraction) / (base_fraction * (1 - fraction))  # code chars kept, chat chars fixed
    step = 1 / keep
    return chats + [code[int(i * step)] for i in range(int(len(code) * keep))]


def run_pilot(name: str, spec, tokenizer, train, heldout, seconds: float, prompts: int, workdir: str) -> dict:
    """Train one candidate for ``seconds`` worth of its measured throughput and measure it."""
    convs = with_code_fraction(train, spec.code_fraction, tt.BENCH_SPEC.code_fraction)
    rows = tt.pack_conversations(tokenizer, convs, spec)  # (N, T)
    rate = time_candidate(spec, tokenizer, rows, steps=3)["tokens_per_second"]
    spec = replace(spec, train_tokens=int(rate * seconds))
    torch.manual_seed(0)
    model = tt.build_model(spec, tokenizer)
    start = time.perf_counter()
    metrics = pretrain(model, rows, spec, seed=0)
    train_seconds = time.perf_counter() - start
    ppl = {k: tt.heldout_perplexity(model, tt.encode_heldout(tokenizer, v, spec.seq_len), tokenizer.pad_token_id)
           for k, v in heldout.items()}
    out = os.path.join(workdir, name)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    quality = json.loads(_quality_json(out, prompts))
    params = tt.count_parameters(model)
    return {"overrides": PILOTS[name], "parameters": params["total"], "active_per_token": params["active_per_token"],
            "tokens_per_second": rate, "tokens_trained": metrics["tokens_trained"], "train_seconds": train_seconds,
            "final_train_loss": metrics["final_train_loss"], "heldout_ppl": ppl["chat"]["ppl"],
            "heldout_assistant_ppl": ppl["chat"]["assistant_ppl"], "heldout_code_ppl": ppl["code"]["ppl"],
            "code_train_share": sum(map(is_code_chat, convs)) / len(convs), "quality": quality}


def _quality_json(target_dir: str, prompts: int) -> str:
    write_quality(target_dir, target_dir, limit=prompts, max_new_tokens=64)
    with open(os.path.join(target_dir, "quality.json")) as f:
        return f.read()


def markdown(record: dict) -> str:
    """The pilots side by side."""
    lines = ["| candidate | parameters (active) | tokens / s | tokens trained | chat ppl (assistant) | code ppl | "
             "SB distinct | SB 4-grams | HE distinct | HE code | union (of E) |", "|---|" * 1 + "---|" * 10]
    for name, r in record["pilots"].items():
        q = r["quality"]["benchmarks"]
        sb, he = q.get("spec_bench", {}), q.get("humaneval", {})
        lines.append(
            f"| {name} | {r['parameters'] / 1e6:.1f} M ({r['active_per_token'] / 1e6:.1f} M) | "
            f"{r['tokens_per_second']:.0f} | {r['tokens_trained'] / 1e6:.2f} M | {r['heldout_ppl']:.1f} "
            f"({r['heldout_assistant_ppl']:.1f}) | {r['heldout_code_ppl']:.1f} | "
            f"{100 * sb.get('distinct_prefix_share', 0):.0f} % | {sb.get('distinct_4gram_ratio') or 0:.2f} | "
            f"{100 * he.get('distinct_prefix_share', 0):.0f} % | {100 * (he.get('code_share') or 0):.0f} % | "
            f"{100 * sb.get('natural_union_fraction_mean', 0):.0f} % |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", default="bench,bench-h192,bench-batch4")
    parser.add_argument("--seconds", type=float, default=240.0, help="training compute per candidate (at its rate)")
    parser.add_argument("--prompts", type=int, default=12, help="Spec-Bench and HumanEval prompts for the quality row")
    parser.add_argument("--output", default="runs/tiny_target_pilots")
    args = parser.parse_args()
    os.makedirs(args.output, exist_ok=True)
    path = os.path.join(args.output, "pilots.json")
    record = {"seconds": args.seconds, "pilots": {}}
    if os.path.isfile(path):
        with open(path) as f:
            record = json.load(f)
    base = replace(tt.BENCH_SPEC, train_tokens=1_500_000)  # text for the pilots (one epoch at most)
    train, heldout, stats = tt.read_training_chats(base)
    tokenizer = tt.train_tokenizer((m["content"] for conv in train for m in conv), base.vocab_size,
                                   base.max_position_embeddings)
    record["data"] = {"train_conversations": len(train), "code": stats.get("code", {}).get("python")}
    with tt.deterministic_cpu(), tempfile.TemporaryDirectory() as workdir:
        for name in args.candidates.split(","):
            if name in record["pilots"]:
                continue
            spec = replace(base, **PILOTS[name])
            record["pilots"][name] = run_pilot(name, spec, tokenizer, train, heldout, args.seconds, args.prompts,
                                               workdir)
            with open(path, "w") as f:
                json.dump(record, f, indent=2)
            with open(os.path.join(args.output, "pilots.md"), "w") as f:
                f.write(markdown(record))
            print(markdown(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
