"""Add the stepwise agreement to finished `vat eval` outputs written before it existed.

The stepwise agreement (:func:`vat.eval.quality.stepwise_agreement`, docs/eval.md) is the share of a budgeted
output's tokens that the natural target picks greedily after the same prefix. It needs only the target and the
budgeted outputs, which ``generations.jsonl`` keeps, so an older evaluation does not have to be decoded again: for
every budgeted turn, the prompt is rendered as the evaluation rendered it (the conversation so far, the run's own
earlier answers included) and one natural forward compares its greedy choices with the committed tokens. The counts
go into ``eval.json``'s per-prompt quality (which ``vat bench`` pools), the per-benchmark and pooled quality figures
are recomputed and ``report.md`` is rewritten. An output that already has them, or was sampled, is left as it is.

Usage:
    python scripts/backfill_stepwise.py EVAL_DIR [EVAL_DIR ...]     # e.g. runs/<bench>/cells/*/seed*/eval
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def backfill(eval_dir: str, *, target=None, tokenizer=None) -> bool:
    """Add the step counts to one evaluation directory; True when it changed. ``target`` / ``tokenizer``: loaded
    ones to reuse (they must be the evaluation's target)."""
    from vat.eval.benchmarks import load_benchmark
    from vat.eval.prompts import render_chat
    from vat.eval.quality import add_counts, empty_counts, stepwise_agreement, summarize_quality
    from vat.eval.report import write_outputs

    with open(os.path.join(eval_dir, "eval.json")) as f:
        result = json.load(f)
    if float(result["settings"].get("temperature", 0.0)) != 0.0:
        return False  # sampled outputs: the stepwise agreement is defined for greedy runs only
    todo = {(label, budget) for label, per_budget in result["per_prompt"].items()  # budgeted rows without step counts
            for budget, per_bench in per_budget.items()
            if any("quality" in e and "step_turns" not in e["quality"] for es in per_bench.values() for e in es)}
    if not todo:
        return False
    if target is None or tokenizer is None:
        target, tokenizer = _load(result["target"], result["target_info"])
    limit = result["settings"].get("limit")
    sources = result.get("benchmark_sources", {})  # a question file's path; older evals: the name alone
    questions = {name: {p.question_id: p.turns for p in load_benchmark(sources.get(name, name), limit=limit)}
                 for name in result["benchmarks"]}
    steps: dict[tuple, dict] = {}  # (label, budget, benchmark, question_id) -> step counts summed over turns
    with open(os.path.join(eval_dir, "generations.jsonl")) as f:
        for row in map(json.loads, f):
            key = (row["draft"], row["budget"])
            if key not in todo:
                continue
            messages, counts = [], {"step_matches": 0, "step_compared": 0, "step_turns": 0}
            for question, output, text in zip(questions[row["benchmark"]][row["question_id"]], row["token_ids"],
                                              row["text"]):
                messages.append({"role": "user", "content": question})
                for k, v in stepwise_agreement(target, render_chat(tokenizer, messages), output).items():
                    counts[k] += v
                messages.append({"role": "assistant", "content": text})
            steps[(*key, row["benchmark"], row["question_id"])] = counts
    for label, budget in todo:
        pooled = empty_counts()
        for bench, entries in result["per_prompt"][label][budget].items():
            total = empty_counts()
            for entry in entries:
                entry["quality"].update(steps[(label, budget, bench, entry["question_id"])])
                add_counts(total, entry["quality"])
            metrics = result["results"][label][budget][bench]
            metrics["quality"] = summarize_quality(total, True, metrics["quality"].get("reference"))
            add_counts(pooled, total)
        pooled_entry = result["pooled"][label][budget]
        pooled_entry["quality"] = summarize_quality(pooled, True, pooled_entry.get("quality", {}).get("reference"))
    write_outputs(result, eval_dir, plots=False)
    return True


def _load(path: str, info: dict) -> tuple:
    """The evaluation's target (its dtype and experts implementation, ``info`` = eval.json's ``target_info``, on the
    CPU) and its tokenizer."""
    from transformers import AutoTokenizer

    from vat.target import load_target

    target = load_target(path, dtype=info["dtype"], device="cpu", experts_impl=info["experts_impl"])
    return target, AutoTokenizer.from_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("eval_dirs", nargs="+", help="vat eval output directories (eval.json + generations.jsonl)")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    loaded: dict[str, tuple] = {}  # target path -> (target, tokenizer), shared by the directories of one bench
    for eval_dir in args.eval_dirs:
        with open(os.path.join(eval_dir, "eval.json")) as f:
            result = json.load(f)
        path = result["target"]
        if path not in loaded:
            loaded[path] = _load(path, result["target_info"])
        changed = backfill(eval_dir, target=loaded[path][0], tokenizer=loaded[path][1])
        print(f"{eval_dir}: {'stepwise agreement added' if changed else 'nothing to add'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
