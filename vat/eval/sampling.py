"""Token choice and acceptance rules of speculative decoding: pure tensor functions, no model.

Greedy (T = 0): a draft is accepted iff it equals the target's argmax at its position (lossless by construction).

Sampling (T > 0), chain: the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023). Draft token d was
drawn from q; accept it with probability min(1, p(d) / q(d)); on rejection draw from norm(max(p - q, 0)) and stop;
after K accepted drafts draw the bonus token from p. The committed token is distributed exactly as p.

Sampling, tree: children of a node are a *deterministic* function of the draft (top-k), i.e. point masses, for which
the rule above becomes: try the children in order; accept child c with probability p_r(c) (p_r = the residual target
distribution, renormalised), else remove c from p_r; when every child is rejected draw from p_r. The committed token
is again distributed exactly as p, whatever the draft proposed (SGLang's "target-only" tree sampling).
"""

from __future__ import annotations

import torch


def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(…, V) logits -> (…, V) fp32 probabilities of softmax(logits / T); T must be > 0."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def choose_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> int:
    """The target's next token from one position's (V,) logits: argmax when T = 0, else a sample at temperature T."""
    if temperature <= 0:
        return int(logits.argmax())
    return sample(target_probs(logits, temperature), generator)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One draw from a (V,) probability vector (need not be normalised)."""
    return int(torch.multinomial(probs.float(), 1, generator=generator))


def uniform(generator: torch.Generator | None = None) -> float:
    """A U(0, 1) draw from ``generator``."""
    device = generator.device if generator is not None else None
    return float(torch.rand((), generator=generator, device=device))


def acceptance_probability(p: torch.Tensor, q: torch.Tensor, token: int) -> float:
    """min(1, p(d) / q(d)) for a draft token d drawn from q (1 when q(d) = 0 cannot happen for a drawn token).

    Args:
        p: (V,) target probabilities at the position.
        q: (V,) draft probabilities the token was drawn from (target vocabulary).
        token: d.
    """
    qd = float(q[token])
    if qd <= 0.0:
        return 1.0 if float(p[token]) > 0 else 0.0
    return min(1.0, float(p[token]) / qd)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)): what to draw from after rejecting a draft from q. Falls back to p when p == q.

    Args:
        p: (V,) target probabilities.
        q: (V,) draft probabilities.

    Returns:
        (V,) probabilities (fp32, or fp64 for fp64 inputs).
    """
    dtype = torch.promote_types(torch.promote_types(p.dtype, q.dtype), torch.float32)
    r = (p.to(dtype) - q.to(dtype)).clamp_min(0.0)  # (V,)
    total = float(r.sum())
    return r / total if total > 0 else p.to(dtype) / float(p.sum())


def accept_chain_greedy(target_ids: torch.Tensor, draft_ids: torch.Tensor) -> int:
    """Number of leading drafts equal to the target's argmax.

    Args:
        target_ids: (K + 1,) argmax of the verification logits (position i predicts the token after block entry i).
        draft_ids: (K,) drafted tokens.

    Returns:
        a in 0..K; the bonus token is ``target_ids[a]``.
    """
    k = draft_ids.shape[0]
    match = (target_ids[:k] == draft_ids).long()  # (K,)
    return int(match.cumprod(0).sum())


def accept_chain_sampling(
    p: torch.Tensor, q: torch.Tensor, draft_ids: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """Standard rejection sampling over a chain.

    Args:
        p: (K + 1, V) target probabilities at temperature T (row i: the distribution of the token after entry i).
        q: (K, V) the draft distributions the drafts were drawn from (target vocabulary).
        draft_ids: (K,) drafted tokens.
        generator: randomness for the coins and the corrected draw.

    Returns:
        ``(a, next_token)``: a accepted drafts, then the token committed after them (a correction or the bonus).
    """
    k = draft_ids.shape[0]
    for i in range(k):
        token = int(draft_ids[i])
        if uniform(generator) < acceptance_probability(p[i], q[i], token):
            continue
        return i, sample(residual_distribution(p[i], q[i]), generator)
    return k, sample(p[k], generator)


def accept_children_sampling(
    p: torch.Tensor, children: list[int], generator: torch.Generator | None = None
) -> tuple[int | None, torch.Tensor]:
    """One node of tree rejection sampling with point-mass drafts.

    Args:
        p: (V,) target probabilities after the node.
        children: the children's tokens, in the order they are tried (the draft's ranking); distinct.
        generator: randomness.

    Returns:
        ``(index, residual)``: the index in ``children`` of the accepted child, or None when all were rejected;
        then ``residual`` (V,) is the distribution to draw the committed token from.
    """
    residual = p.float().clone()
    for i, token in enumerate(children):
        total = float(residual.sum())
        if total <= 0:
            break
        if uniform(generator) < float(residual[token]) / total:
            return i, residual
        residual[token] = 0.0
    if float(residual.sum()) <= 0:  # every token with mass was a (rejected) child: cannot happen for exact p
        residual = p.float().clone()
    return None, residual
