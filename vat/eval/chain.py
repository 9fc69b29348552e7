"""EAGLE-3 chain drafting (top-1, K steps) and chain verification on the target.

A round: the draft proposes d_1..d_K from its head; the target runs ``[root, d_1, ..., d_K]`` at positions
``n..n+K`` over its KV cache (one budget window); drafts are accepted left to right (:mod:`vat.eval.sampling`); the
target cache is cropped to the root plus the accepted drafts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vat.eval.draft_state import DraftHead, DraftState
from vat.eval.sampling import accept_chain_greedy, accept_chain_sampling, target_probs


@dataclass
class ChainDraft:
    """A drafted chain.

    Attributes:
        tokens: (K',) drafted tokens, target vocabulary (K' < K when the verification head stopped drafting).
        q: (K', V) the draft distributions they were drawn from (target vocabulary), or None when greedy.
        probs: the draft's probability of each drafted token (K' floats; None when not recorded, e.g. n-gram).
        vh: the verification head's probability at the hidden state that drafted each token (None without a head).
    """

    tokens: torch.Tensor
    q: torch.Tensor | None
    probs: list[float] | None = None
    vh: list[float] | None = None

    def prefix(self, n: int) -> ChainDraft:
        """The first ``n`` drafts (itself when ``n`` keeps them all): what a chain-cutting policy verifies."""
        if n >= int(self.tokens.shape[0]):
            return self
        return ChainDraft(tokens=self.tokens[:n], q=None if self.q is None else self.q[:n],
                          probs=None if self.probs is None else self.probs[:n],
                          vh=None if self.vh is None else self.vh[:n])


def _vh_stops(vh_logit: float | None, threshold: float | None) -> bool:
    """True when the verification head predicts rejection: sigmoid(logit) < threshold."""
    if threshold is None or vh_logit is None:
        return False
    return 1.0 / (1.0 + math.exp(-vh_logit)) < threshold


@torch.no_grad()
def draft_chain(
    state: DraftState,
    head: DraftHead,
    num_steps: int,
    *,
    vh_threshold: float | None = None,
    confidence: float | None = None,
    generator: torch.Generator | None = None,
) -> ChainDraft:
    """Draft up to ``num_steps`` tokens, one draft step each, from the head; speculative entries are cropped after.

    Args:
        state: the draft state (its cache is restored to its length on entry).
        head: the draft's output at the newest committed entry.
        num_steps: K.
        vh_threshold: stop before a token whose verification-head probability is below this (None = never).
        confidence: stop after a token the draft gave less than this probability; that token is kept (transformers'
            ``ConfidenceCriteria``, its ``assistant_confidence_threshold``; None = never).
        generator: randomness for sampled drafts (temperature > 0).

    Returns:
        A :class:`ChainDraft`.
    """
    prefix = state.cache.length
    hidden, logits, vh = head.hidden, head.logits, head.vh_logit
    tokens: list[torch.Tensor] = []
    qs: list[torch.Tensor] = []
    chosen: list[float] = []  # the draft's probability of each drafted token (EVICT's benefit)
    vhs: list[float] = []
    for k in range(num_steps):
        if _vh_stops(vh, vh_threshold):
            break
        scaled = state.scaled_logits(logits)  # (V_d,)
        probs = torch.softmax(scaled.float(), dim=-1)  # (V_d,)
        if state.temperature > 0:
            draft_id = torch.multinomial(probs, 1, generator=generator)  # (1,)
            qs.append(state.target_probs(probs))  # (V,)
        else:
            draft_id = scaled.argmax().view(1)
        chosen.append(float(probs[draft_id]))
        if vh is not None:
            vhs.append(1.0 / (1.0 + math.exp(-vh)))
        token = state.to_target_ids(draft_id)  # (1,)
        tokens.append(token)
        if k == num_steps - 1 or (confidence is not None and chosen[-1] < confidence):
            break
        out = state.drafter.step(state.cache, token[None], hidden=hidden[None, None])
        hidden, logits = out.hidden[0, 0], out.logits[0, 0]
        vh = None if out.vh_logits is None else float(out.vh_logits[0, 0])
    state.cache.crop(prefix)
    device = head.logits.device
    drafted = torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.long, device=device)
    q = torch.stack(qs) if qs else None
    if state.temperature > 0 and q is None:
        q = torch.zeros(0, state.vocab_size, device=device)
    return ChainDraft(tokens=drafted, q=q, probs=chosen, vh=vhs if len(vhs) == len(chosen) and vhs else None)


@dataclass
class ChainVerdict:
    """Outcome of verifying a chain.

    Attributes:
        accepted: a, the number of drafts accepted.
        next_token: the token the target commits after them (correction or bonus).
    """

    accepted: int
    next_token: int


def judge_chain(
    logits: torch.Tensor,
    draft: ChainDraft,
    temperature: float,
    generator: torch.Generator | None = None,
) -> ChainVerdict:
    """Accept drafts from the verification logits.

    Args:
        logits: (K' + 1, V) target logits of the block ``[root, d_1..d_K']``.
        draft: the chain.
        temperature: 0 = greedy acceptance, else rejection sampling at this temperature.
        generator: randomness for sampling.

    Returns:
        A :class:`ChainVerdict`.
    """
    if temperature <= 0:
        target_ids = logits.argmax(dim=-1)  # (K'+1,)
        a = accept_chain_greedy(target_ids, draft.tokens)
        return ChainVerdict(accepted=a, next_token=int(target_ids[a]))
    p = target_probs(logits, temperature)  # (K'+1, V)
    a, token = accept_chain_sampling(p, draft.q, draft.tokens, generator)
    return ChainVerdict(accepted=a, next_token=token)
