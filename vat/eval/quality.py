"""Output quality under an expert budget (docs/eval.md): a budgeted target is another model.

For every budgeted run of ``vat eval`` and every prompt turn, against the natural (unbudgeted) greedy decode of the
same prompt:

- ``agreement``: per-token agreement of the budgeted output with the natural greedy output, position by position,
  over the longer of the two (a length mismatch counts as disagreement); pooled as Σ matches / Σ compared.
- ``first_divergence``: tokens until the first position where the two differ (the whole output when identical;
  the shorter length when one is a prefix of the other); mean over turns.
- ``stepwise_agreement``: the share of the budgeted output's tokens that the natural target picks greedily after the
  same prefix (one natural forward over the budgeted output, teacher-forced: a first divergence does not carry into
  the tokens after it, as it does in ``agreement``). 1 without a budget (greedy decoding is lossless); unlike the KL
  it depends on the draft, whose tokens choose the expert set at serving.
- ``kl_to_natural``: KL(budgeted ‖ natural) of the next-token distribution on the target's own text (the natural
  greedy output after its prompt), the figure ``vat profile`` measures (:func:`kl_divergence`), with the
  prompt prefilled unbudgeted and the response tiled into windows of the draft's verification block from its first
  position, as served; mean over the response positions (Σ KL / Σ positions).

With ``--reference-target`` the natural output and distribution are another model's (a Window Pool target's base):
every figure is taken against it and every pass, natural routing included, gets one (``run.py``).

Agreement and first divergence compare greedy outputs: at temperature > 0 the budgeted output is sampled and they are
None; the KL needs no sampling and is always given. Every figure is a ratio of global sums, so pooling is exact.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace

import torch

from vat.target import BudgetSpec

COUNT_KEYS = ("matches", "compared", "first_divergence", "turns", "identical", "kl_sum", "kl_count",
              "step_matches", "step_compared", "step_turns")



def kl_divergence(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position from logits, in fp32.

    Args:
        logits_p: (..., V) logits of p (the budgeted distribution).
        logits_q: (..., V) logits of q (the unbudgeted one).

    Returns:
        (...,) KL in nats; exactly 0 where the logits are identical.
    """
    logp = torch.log_softmax(logits_p.float(), dim=-1)
    logq = torch.log_softmax(logits_q.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)

def sequence_agreement(output: Sequence[int], reference: Sequence[int]) -> dict[str, int]:
    """Position-by-position agreement of one generated sequence with the natural one.

    Args:
        output: the budgeted run's generated token ids.
        reference: the natural greedy decode's token ids for the same prompt turn.

    Returns:
        ``matches`` (positions where both have the same token), ``compared`` (max of the two lengths),
        ``first_divergence`` (index of the first differing position; min length if one is a prefix of the other,
        the length if identical) and ``identical`` (0/1).
    """
    n = min(len(output), len(reference))
    same = [a == b for a, b in zip(output[:n], reference[:n])]
    first = next((i for i, s in enumerate(same) if not s), n)
    identical = int(list(output) == list(reference))
    return {"matches": sum(same), "compared": max(len(output), len(reference)), "first_divergence": first,
            "identical": identical}


def empty_counts() -> dict[str, float]:
    return {key: 0.0 for key in COUNT_KEYS}


def add_counts(into: dict[str, float], other: dict[str, float]) -> dict[str, float]:
    for key in COUNT_KEYS:
        into[key] = into.get(key, 0.0) + float(other.get(key, 0.0))
    return into


def summarize_quality(counts: dict[str, float], greedy: bool, reference: str | None = None) -> dict:
    """The eval.json ``quality`` entry from summed counts.

    Returns:
        ``agreement``, ``stepwise_agreement`` (None unless every pooled turn carries its step counts: an older
        eval.json has none), ``first_divergence`` (mean tokens until the first divergence per turn), ``identical_turns``
        (share of turns identical to the natural output), ``kl_to_natural`` (nats per response token), the counts
        behind them and ``reference`` (where the natural output came from).
    """
    turns = counts["turns"]
    stepwise = greedy and counts.get("step_compared") and counts.get("step_turns") == turns  # every turn measured
    return {
        "agreement": counts["matches"] / counts["compared"] if greedy and counts["compared"] else None,
        "stepwise_agreement": counts["step_matches"] / counts["step_compared"] if stepwise else None,
        "first_divergence": counts["first_divergence"] / turns if greedy and turns else None,
        "identical_turns": counts["identical"] / turns if greedy and turns else None,
        "kl_to_natural": counts["kl_sum"] / counts["kl_count"] if counts["kl_count"] else None,
        "compared_tokens": int(counts["compared"]),
        "kl_tokens": int(counts["kl_count"]),
        "turns": int(turns),
        "reference": reference,
    }


@torch.no_grad()
def stepwise_agreement(target, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> dict[str, int]:
    """How many tokens of a budgeted output the natural target picks itself after the same prefix.

    One natural forward over ``prompt + output[:-1]``: the greedy choice at each output position given the budgeted
    run's own prefix, compared with the token the budgeted run committed there.

    Args:
        target: a :class:`~vat.target.FrozenTarget`.
        prompt_ids: the rendered prompt of the budgeted run's turn (its own earlier answers included).
        output_ids: the budgeted run's generated tokens of that turn.

    Returns:
        ``step_matches`` (positions where the natural greedy choice is the committed token), ``step_compared`` (the
        output's length) and ``step_turns`` (1).
    """
    n = len(output_ids)
    if n == 0:
        return {"step_matches": 0, "step_compared": 0, "step_turns": 1}
    start = len(prompt_ids)
    input_ids = torch.tensor([list(prompt_ids) + list(output_ids[:-1])], device=target.device)  # (1, P + n - 1)
    logits = target.forward(input_ids, output_aux=False, capture_routing=False).logits[0, start - 1:]  # (n, V)
    choice = logits.argmax(dim=-1)  # (n,) the natural greedy token after each prefix
    committed = torch.tensor(list(output_ids), device=choice.device)  # (n,)
    return {"step_matches": int((choice == committed).sum()), "step_compared": n, "step_turns": 1}


@torch.no_grad()
def response_kl(target, prompt_ids: Sequence[int], response_ids: Sequence[int],
                specs: Mapping[Hashable, BudgetSpec], natural_target=None) -> dict[Hashable, tuple[float, int]]:
    """KL(budgeted ‖ natural) of the next-token distribution over the response positions of the target's own text.

    One natural forward over ``prompt + response`` and one budgeted forward per spec: positions before the response
    are not budgeted (the prompt's prefill, as served); the response is tiled into windows of ``spec.window``
    positions from its first position (None = the whole response is one window).

    Args:
        target: a :class:`~vat.target.FrozenTarget`.
        prompt_ids: the rendered prompt of the natural conversation's turn.
        response_ids: the natural greedy output of that turn.
        specs: ``{key: BudgetSpec}``: B, policy, window and whatever the eval policies set on the spec (the same
            ``budget_spec`` hooks the verification forwards get, e.g. AcceptMoE's commitment, whose depths are each
            window's positions from its first, as a chain's); the windows' offset and start are set here. A spec
            with ``B=None`` is the target at natural routing (against another ``natural_target``).
        natural_target: the model of the natural distribution (default ``target``): e.g. the base a Window Pool
            target was trained from, whose text ``response_ids`` then is.

    Returns:
        ``{key: (Σ KL over response positions, number of positions)}`` for every key of ``specs``.
    """
    start = len(prompt_ids)
    n = len(response_ids)
    if n == 0 or not specs:
        return {key: (0.0, 0) for key in specs}
    input_ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=target.device)  # (1, P + n)
    natural_model = target if natural_target is None else natural_target
    natural = natural_model.forward(input_ids, output_aux=False, capture_routing=False).logits[0, start:]  # (n, V)
    out = {}
    for key, spec in specs.items():
        placed = None if spec.B is None else replace(spec, offset=start, start_position=start)
        budgeted = target.forward(input_ids, budget=placed, output_aux=False, capture_routing=False).logits[0, start:]
        out[key] = (float(kl_divergence(budgeted, natural).double().sum()), n)  # (n,) summed
    return out
