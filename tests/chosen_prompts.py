"""Prompts a test picks from the target it has.

What a trained tiny target generates depends on its build: another CPU (floating-point order) or another
``$VAT_TINY_SEED`` gives other weights and other greedy answers. A test that needs a prompt with some property of the
target's output (a drafted token accepted, a budget that changes the answer) does not hope that the first prompts of
a benchmark have it: it runs the cheap configuration that shows the property over a pool of candidates, keeps the
prompts that have it, and runs what it tests on those. A pool in which no prompt has it fails with one line that says
so (a build that never accepts a drafted token is a broken build, not a flaky test).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from vat.eval.benchmarks import load_benchmark
from vat.eval.run import run_eval


def choose_prompts(
    benchmark: str,
    draft,
    keep: Callable[[dict], bool],
    output: str,
    *,
    n: int = 1,
    others: int = 1,
    pool: int = 48,
    chunk: int = 8,
    budget: int | None = None,
    **eval_kwargs,
) -> str:
    """Write the first ``n`` prompts of ``benchmark`` whose per-prompt counts satisfy ``keep`` to a question file,
    then the first ``others`` of the rest, taken as they come (so the run under test sees both kinds).

    Args:
        benchmark: a benchmark name or file for :func:`vat.eval.benchmarks.load_benchmark` (``:category`` allowed).
        draft: one draft as :func:`vat.eval.run.run_eval` takes it (``"ngram"``, a ``(label, draft)`` pair, ...).
        keep: the property, read from one prompt's entry of ``per_prompt`` (``accepted``, ``committed``, ...).
        output: the question file to write (FastChat JSON Lines; its stem names the benchmark in an eval).
        n: prompts with the property wanted (first in the file).
        others: prompts of the pool added after them regardless of the property.
        pool: candidate prompts read from ``benchmark`` (spread over its categories, as an eval reads them).
        chunk: candidates evaluated per selecting run (the search stops once ``n`` prompts have the property).
        budget: the expert budget of the selecting run (None = natural routing).
        eval_kwargs: the rest of the selecting run's settings (``target``, ``steps``, ``max_new_tokens``, ...); give
            the run under test the same ones, so the property carries over.

    Returns:
        ``output``.
    """
    label = draft[0] if isinstance(draft, tuple) else str(draft)
    candidates = load_benchmark(benchmark, limit=pool)  # spread over categories, as an eval reads them
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    kept, seen = [], []
    for start in range(0, len(candidates), chunk):  # a few prompts at a time: stop as soon as enough have it
        _write_questions(output, candidates[start : start + chunk])
        ev = run_eval(drafts=[draft], benchmarks=[output], budgets=[budget], autoregressive=False, progress=False,
                      plots=False, **eval_kwargs)
        (bench,) = ev["benchmarks"]
        entries = ev["per_prompt"][label]["none" if budget is None else str(budget)][bench]
        seen += [e["question_id"] for e in entries]
        kept += [e["question_id"] for e in entries if keep(e)]
        if len(kept) >= n:
            break
    assert len(kept) >= n, f"only {len(kept)} of {len(seen)} prompts of {benchmark} have the property; need {n}"
    kept = kept[:n] + [q for q in seen if q not in kept[:n]][:others]
    by_id = {p.question_id: p for p in candidates}
    _write_questions(output, [by_id[q] for q in kept])
    return output


def _write_questions(path: str, prompts) -> None:
    """FastChat JSON Lines: one ``{question_id, category, turns}`` per prompt."""
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"question_id": p.question_id, "category": p.category, "turns": p.turns}) + "\n")
