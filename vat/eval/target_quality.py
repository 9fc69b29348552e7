"""Does a target carry evidence? Per benchmark, how much its greedy answers depend on the prompt.

A draft's τ on a benchmark says something only if the target's answers there differ from prompt to prompt: a target
that answers every HumanEval prompt with the same string makes "HumanEval τ" the τ of one degenerate string, and a
bootstrap over its prompts reports an interval far narrower than the evidence. The table per benchmark:

* ``distinct_prefix_share``: share of prompts whose first ``prefix`` (32) greedy tokens differ from every other
  prompt's first ``prefix`` tokens;
* ``distinct_4gram_ratio``: mean over answers of distinct 4-grams / 4-grams (1 = no 4-gram repeats; a loop of a
  short phrase goes towards 0);
* ``ended_share``: share of answers that end with an end-of-turn token within the token cap;
* ``code_share``: share of answers that read as Python (:func:`looks_like_code`), the figure for code benchmarks;
* ``natural_union_fraction``: the natural expert union per ``window``-token window of the answers, per MoE layer, as
  a fraction of E (the room an expert budget has).

Pure functions of token ids and text, plus :func:`greedy_answers` and :func:`target_quality`, which run the target.
"""

from __future__ import annotations

import ast
import json
import os
import re
from collections.abc import Sequence

import torch
from transformers import AutoTokenizer

from vat.eval.benchmarks import load_benchmark
from vat.eval.engine import SpeculativeEngine
from vat.eval.prompts import decode, eos_token_ids, render_chat
from vat.target import contiguous_windows, load_target, window_union

CODE_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)(?:```|$)", re.DOTALL)


def distinct_prefix_share(answers: Sequence[Sequence[int]], prefix: int = 32) -> float:
    """Share of answers whose first ``prefix`` tokens appear as no other answer's first ``prefix`` tokens."""
    if not answers:
        raise ValueError("no answers")
    heads = [tuple(a[:prefix]) for a in answers]
    counts: dict[tuple, int] = {}
    for head in heads:
        counts[head] = counts.get(head, 0) + 1
    return sum(counts[h] == 1 for h in heads) / len(heads)


def distinct_ngram_ratio(tokens: Sequence[int], n: int = 4) -> float | None:
    """Distinct n-grams / n-grams of one answer (None when it has fewer than ``n`` tokens)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def _code_body(text: str) -> str:
    """The first fenced block's content if the text has one, else the text."""
    match = CODE_FENCE.search(text)
    return match.group(1) if match else text


def looks_like_code(text: str, min_lines: int = 2) -> bool:
    """True when the answer (its first fenced block, if any) is Python: a leading run of at least ``min_lines``
    non-empty lines that parses, with a ``def``, ``class``, ``return``, ``import`` or assignment in it.

    An answer cut by the token cap is usually cut mid-statement, so the longest parsing prefix of its lines counts,
    not the whole text.
    """
    lines = _code_body(text).splitlines()
    for end in range(len(lines), 0, -1):
        chunk = "\n".join(lines[:end])
        if sum(bool(line.strip()) for line in lines[:end]) < min_lines:
            return False
        try:
            tree = ast.parse(chunk)
        except (SyntaxError, ValueError):
            continue
        return any(isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Return, ast.Import, ast.ImportFrom,
                                     ast.Assign, ast.AugAssign)) for node in ast.walk(tree))
    return False


def greedy_answers(target, tokenizer, questions: Sequence[str], max_new_tokens: int) -> list[dict]:
    """The target's own greedy answer to each single-turn question (the eval engine's autoregressive decode).

    Returns:
        Per question: ``prompt_ids``, ``answer_ids`` (EOS excluded), ``ended`` (stopped on an end-of-turn token) and
        ``text``.
    """
    eos = set(eos_token_ids(tokenizer, target.model))
    engine = SpeculativeEngine(target, None, max_new_tokens=max_new_tokens, eos_token_ids=eos)
    answers = []
    for question in questions:
        prompt = render_chat(tokenizer, [{"role": "user", "content": question}])
        ids = engine.generate(prompt).token_ids
        ended = bool(ids) and ids[-1] in eos
        body = ids[:-1] if ended else ids
        answers.append({"prompt_ids": prompt, "answer_ids": body, "ended": ended, "text": decode(tokenizer, body)})
    return answers


@torch.no_grad()
def natural_union_fraction(target, sequences: Sequence[Sequence[int]], window: int = 8) -> list[float]:
    """Mean natural expert union per ``window``-token window, per MoE layer, as a fraction of E, over sequences."""
    unions = []
    for ids in sequences:
        input_ids = torch.tensor([list(ids)], device=target.device)  # (1, T)
        out = target.forward(input_ids, output_aux=False, capture_routing=True)
        groups, n_groups = contiguous_windows(torch.ones_like(input_ids, dtype=torch.bool), window)
        unions.append(window_union(out.topk_ids, groups, n_groups, target.num_experts).double())  # (L', G)
    per_layer = torch.cat(unions, dim=1).mean(dim=1) / target.num_experts  # (L',)
    return [float(u) for u in per_layer]


def summarize_answers(answers: Sequence[dict], code: bool, prefix: int = 32) -> dict:
    """The table row of one benchmark from :func:`greedy_answers`' output (no model needed)."""
    ratios = [r for r in (distinct_ngram_ratio(a["answer_ids"]) for a in answers) if r is not None]
    return {
        "n_prompts": len(answers),
        "distinct_prefix_share": distinct_prefix_share([a["answer_ids"] for a in answers], prefix),
        "distinct_4gram_ratio": sum(ratios) / len(ratios) if ratios else None,
        "ended_share": sum(a["ended"] for a in answers) / len(answers),
        "code_share": sum(looks_like_code(a["text"]) for a in answers) / len(answers) if code else None,
    }


def target_quality(target, tokenizer, benchmarks: dict[str, list[str]], *, max_new_tokens: int = 96,
                   window: int = 8, code_benchmarks: Sequence[str] = ("humaneval",)) -> dict:
    """The target-quality table: one row per benchmark (``{name: [question, ...]}``), with one example answer each.

    Returns:
        ``{"settings": {...}, "benchmarks": {name: row}}``; each row is :func:`summarize_answers`' plus
        ``natural_union_fraction`` (per MoE layer), its mean, and ``example`` (the first prompt's answer text).
    """
    rows = {}
    for name, questions in benchmarks.items():
        answers = greedy_answers(target, tokenizer, questions, max_new_tokens)
        row = summarize_answers(answers, code=name in code_benchmarks)
        per_layer = natural_union_fraction(target, [a["prompt_ids"] + a["answer_ids"] for a in answers], window)
        row.update(natural_union_fraction=per_layer, natural_union_fraction_mean=sum(per_layer) / len(per_layer),
                   example={"question": questions[0], "answer": answers[0]["text"]})
        rows[name] = row
    return {"settings": {"max_new_tokens": max_new_tokens, "window": window, "prefix": 32,
                         "num_experts": target.num_experts, "top_k": target.top_k},
            "benchmarks": rows}


def quality_markdown(report: dict) -> str:
    """The table as Markdown, beside the seed papers' figure for OLMoE-1B-7B."""
    lines = [
        "| benchmark | prompts | distinct 32-token answers | distinct 4-grams | ended turns | code | "
        f"natural union / {report['settings']['window']} tokens (of E) |",
        "|---|---|---|---|---|---|---|",
    ]
    pct = lambda v: "–" if v is None else f"{100 * v:.0f} %"  # noqa: E731
    for name, r in report["benchmarks"].items():
        grams = "–" if r["distinct_4gram_ratio"] is None else f"{r['distinct_4gram_ratio']:.2f}"
        lines.append(f"| {name} | {r['n_prompts']} | {pct(r['distinct_prefix_share'])} | {grams} | "
                     f"{pct(r['ended_share'])} | {pct(r['code_share'])} | {pct(r['natural_union_fraction_mean'])} |")
    lines += ["", "OLMoE-1B-7B for comparison (seed papers): a large draft tree touches about 54 of 64 experts "
              "(84 %) per layer.", ""]
    for name, r in report["benchmarks"].items():
        lines += [f"**{name}**, first prompt: {r['example']['question'][:200]!r}", "",
                  "```", r["example"]["answer"][:600], "```", ""]
    return "\n".join(lines)


def write_quality(target_dir: str, output_dir: str, *, benchmarks: Sequence[str] = ("spec_bench", "humaneval"),
                  limit: int = 40, max_new_tokens: int = 96, window: int = 8, **load_kwargs) -> str:
    """Load the target at ``target_dir``, measure its quality table on ``benchmarks`` (``limit`` prompts each, spread
    over categories) and write ``quality.json`` and ``quality.md`` into ``output_dir``; returns the Markdown."""
    target = load_target(target_dir, **load_kwargs)
    try:
        tokenizer = AutoTokenizer.from_pretrained(target.path or target_dir)
        questions = {}
        for name in benchmarks:
            prompts = load_benchmark(name, limit=limit)
            questions[prompts[0].benchmark] = [p.turns[0] for p in prompts]
        report = target_quality(target, tokenizer, questions, max_new_tokens=max_new_tokens, window=window)
    finally:
        target.close()
    report["target"] = target_dir
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "quality.json"), "w") as f:
        json.dump(report, f, indent=2)
    text = quality_markdown(report)
    with open(os.path.join(output_dir, "quality.md"), "w") as f:
        f.write(text)
    return text
