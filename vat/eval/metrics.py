"""Reduce decoded sequences to the metrics of ``eval.json`` (definitions in ``docs/eval.md``).

Everything is a ratio of global sums over the rounds of all sequences (never a mean of per-prompt means), so
pooling benchmarks or categories is exact.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vat.eval.engine import Generation

PERCENTILES = (50, 90, 99)
# per-prompt counts (generations.jsonl per turn, eval.json ``per_prompt`` totals): what `vat bench` resamples
COUNT_KEYS = ("rounds", "committed", "kept", "accepted", "drafted", "expert_bytes")


@dataclass
class PromptRun:
    """The decoded turns of one prompt under one configuration.

    Attributes:
        question_id: the benchmark's id.
        category: the prompt's category.
        turns: one :class:`Generation` per user turn.
        prompt_ids: the rendered prompt of each turn (the conversation so far, the model's own answers included).
    """

    question_id: object
    category: str
    turns: list[Generation]
    prompt_ids: list[list[int]] = field(default_factory=list)


def _ratio(num: float, den: float) -> float | None:
    return float(num) / float(den) if den else None


def acceptance_by_position(rounds: Sequence) -> dict[str, list]:
    """Acceptance per draft position k = 1..K_max (the deepest position drafted) over verification rounds.

    ``conditional[k]`` = P(draft k accepted | the check reached position k); ``unconditional[k]`` = accepted at k /
    rounds with at least one draft (vLLM's ``acceptance_at_pos``). Counts are given too.
    """
    drafting = [r for r in rounds if r.drafted > 0]
    depth = max((r.depth for r in drafting), default=0)
    reached = [sum(r.reached >= k for r in drafting) for k in range(1, depth + 1)]
    accepted = [sum(r.accepted >= k for r in drafting) for k in range(1, depth + 1)]
    return {
        "conditional": [_ratio(a, r) for a, r in zip(accepted, reached)],
        "unconditional": [_ratio(a, len(drafting)) for a in accepted],
        "reached": reached,
        "accepted": accepted,
    }


def union_statistics(unions: torch.Tensor, num_experts: int) -> dict:
    """Statistics of the expert union over (round, MoE layer) pairs.

    Args:
        unions: (R, L') experts executed per layer per verification round.
        num_experts: E (histogram bins 0..E).

    Returns:
        ``mean`` (per layer per round), ``per_layer`` means, ``sum_per_round`` (Σ_l U_l, mean over rounds),
        percentiles ``p50``/``p90``/``p99``, ``max``, and ``histogram`` counts for U = 0..E.
    """
    if unions.numel() == 0:
        return {"mean": None, "per_layer": [], "sum_per_round": None, "max": None,
                "histogram": [0] * (num_experts + 1), **{f"p{q}": None for q in PERCENTILES}}
    u = unions.double()
    flat = u.flatten()
    quantiles = torch.quantile(flat, torch.tensor([q / 100 for q in PERCENTILES], dtype=torch.float64))
    return {
        "mean": float(flat.mean()),
        "per_layer": [float(x) for x in u.mean(dim=0)],
        "sum_per_round": float(u.sum(dim=1).mean()),
        **{f"p{q}": float(v) for q, v in zip(PERCENTILES, quantiles)},
        "max": int(flat.max()),
        "histogram": torch.bincount(unions.flatten().long(), minlength=num_experts + 1).tolist(),
    }


def round_bytes(rounds: Sequence, expert_bytes_per_layer: Sequence[int]) -> torch.Tensor:
    """(R,) float64 expert bytes read by each verification round: Σ_l U_l · b_l (the one accounting of bytes)."""
    if not rounds:
        return torch.zeros(0, dtype=torch.float64)
    unions = torch.tensor([r.union for r in rounds], dtype=torch.float64)  # (R, L')
    return (unions * torch.tensor(list(expert_bytes_per_layer), dtype=torch.float64)).sum(dim=1)


def turn_counts(gen: Generation, expert_bytes_per_layer: Sequence[int]) -> dict:
    """Counts of one turn's verification rounds, the summands of the pooled metrics.

    Returns:
        ``rounds`` (target forwards after the prefill), ``committed`` (Σ accepted + 1: the numerator of
        ``accepted_per_round``), ``kept`` (Σ RoundStats.committed: tokens delivered after EOS / max-new-tokens cuts;
        the numerator of ``tau`` and the denominator of ``expert_bytes_per_token``), ``accepted``, ``drafted`` (ints)
        and ``expert_bytes`` (float).
    """
    rounds = gen.rounds
    return {
        "rounds": len(rounds),
        "committed": sum(r.accepted + 1 for r in rounds),
        "kept": sum(r.committed for r in rounds),
        "accepted": sum(r.accepted for r in rounds),
        "drafted": sum(r.drafted for r in rounds),
        "expert_bytes": float(round_bytes(rounds, expert_bytes_per_layer).sum()),
    }


def prompt_counts(run: PromptRun, expert_bytes_per_layer: Sequence[int]) -> dict[str, list]:
    """:func:`turn_counts` of every turn of a prompt, as ``{key: [value per turn]}`` (generations.jsonl)."""
    turns = [turn_counts(g, expert_bytes_per_layer) for g in run.turns]
    return {key: [t[key] for t in turns] for key in COUNT_KEYS}


def output_hash(run: PromptRun) -> str:
    """A short hash of a prompt's generated token ids, every turn (two runs with equal hashes said the same)."""
    return hashlib.sha1(json.dumps([list(map(int, g.token_ids)) for g in run.turns]).encode()).hexdigest()[:16]


def prompt_totals(run: PromptRun, expert_bytes_per_layer: Sequence[int]) -> dict:
    """One prompt's counts summed over its turns, with its id, category and output hash (eval.json ``per_prompt``)."""
    per_turn = prompt_counts(run, expert_bytes_per_layer)
    totals = {key: sum(values) for key, values in per_turn.items()}
    totals["expert_bytes"] = float(totals["expert_bytes"])
    return {"question_id": run.question_id, "category": run.category, **totals, "output_hash": output_hash(run)}


def summarize(runs: Sequence[PromptRun], expert_bytes_per_layer: Sequence[int], num_experts: int) -> dict:
    """Metrics of a set of prompt runs (one draft x budget x benchmark, or one category of it).

    Args:
        runs: the decoded prompts.
        expert_bytes_per_layer: b_l, one expert's weight bytes per MoE layer.
        num_experts: E.

    Returns:
        The metrics dict (keys documented in ``docs/eval.md``); ``speedup_vs_ar`` is filled by the caller.
    """
    gens = [g for run in runs for g in run.turns]
    rounds = [r for g in gens for r in g.rounds]
    generated = sum(len(g.token_ids) for g in gens)
    seconds = sum(g.seconds for g in gens)
    forwards = sum(g.target_forwards for g in gens)
    round_tokens = sum(r.committed for r in rounds)
    n_layers = len(expert_bytes_per_layer)
    unions = torch.tensor([r.union for r in rounds], dtype=torch.long).view(len(rounds), n_layers)  # (R, L')
    bytes_per_round = round_bytes(rounds, expert_bytes_per_layer)  # (R,)
    return {
        "n_prompts": len(runs),
        "n_turns": len(gens),
        "n_rounds": len(rounds),
        "generated_tokens": generated,
        "tau": _ratio(round_tokens, len(rounds)),  # delivered: acceptances past the cap or an EOS do not count
        "accepted_per_round": _ratio(sum(r.accepted + 1 for r in rounds), len(rounds)),
        "tokens_per_round": _ratio(round_tokens, len(rounds)),
        "drafted_per_round": _ratio(sum(r.drafted for r in rounds), len(rounds)),
        "verified_tokens_per_round": _ratio(sum(r.drafted + 1 for r in rounds), len(rounds)),
        "accept_by_position": acceptance_by_position(rounds),
        "target_forwards_per_token": _ratio(forwards, generated),
        "seconds": seconds,
        "tokens_per_s": _ratio(generated, seconds),
        "speedup_vs_ar": None,
        "union_per_round": union_statistics(unions, num_experts),
        "expert_bytes_per_round": float(bytes_per_round.mean()) if rounds else None,
        "expert_bytes_per_token": _ratio(float(bytes_per_round.sum()), round_tokens),
    }


def by_category(runs: Sequence[PromptRun], expert_bytes_per_layer: Sequence[int], num_experts: int) -> dict:
    """:func:`summarize` per category (categories in order of first appearance)."""
    cats: dict[str, list[PromptRun]] = {}
    for run in runs:
        cats.setdefault(str(run.category), []).append(run)
    return {c: summarize(rs, expert_bytes_per_layer, num_experts) for c, rs in cats.items()}


def set_speedups(metrics: dict, ar_metrics: dict | None) -> None:
    """Fill ``speedup_vs_ar`` = tokens/s over the AR baseline's tokens/s (same prompts, same run), and per category."""
    if ar_metrics is None:
        return
    ar_rate = ar_metrics.get("tokens_per_s")
    rate = metrics.get("tokens_per_s")
    metrics["speedup_vs_ar"] = _ratio(rate, ar_rate) if rate is not None and ar_rate else None
    ar_cats = ar_metrics.get("categories", {})
    for name, cat in metrics.get("categories", {}).items():
        if name in ar_cats:
            set_speedups(cat, ar_cats[name])
