"""The imitation term's per-position loss, a chunk of anchors at a time (the memory-bounded path of the objective).

Per draft position, ``ℓ = soft_weight · (−Σ_v p(v) log q(v)) + hard_weight · (−log q(y))`` with ``q = softmax(z)``
over the draft vocab. Autograd through ``log_softmax`` keeps an fp32 ``(..., K, V_d)`` log-probability tensor and the
product with ``p`` alive until backward; at the shipped recipes' shapes that is 16k tokens x 7 steps x 32k (EAGLE-3)
or 512 blocks x 16 slots x 152k (DFlash) fp32 values per tensor, several GB each. :func:`chunked_imitation` computes
``ℓ`` a chunk of anchors at a time and saves nothing but its inputs; backward recomputes ``softmax(z)`` per chunk and
writes ``∂ℓ/∂z = soft_weight · (q Σp − p) + hard_weight · (q − e_y)`` into one gradient buffer in the logits' dtype.
The transient memory is one chunk's ``(c, K, V_d)`` in fp32 (two in backward). Chunks are slices of the leading dims,
so the target fields may stay strided views (the TTT layout's windows): nothing copies the whole view.

Reference: ``vat.losses`` computes the same ``ℓ`` with autograd when ``loss.imitation_chunk_mb`` is null; the two agree in
value and gradient (``tests/test_imitation.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor


def anchor_chunks(lead: tuple[int, ...], chunk: int) -> Iterator[tuple[slice, ...]]:
    """Slices over the leading dims ``lead`` covering at most ``chunk`` anchors each: whole rows of the first dim when
    a row fits, else pieces of one row (recursively). Slices keep every dim, so each chunk is a view (no gather)."""
    inner = 1
    for d in lead[1:]:
        inner *= d
    if len(lead) == 1 or chunk >= inner:
        rows = max(1, chunk // inner)
        for start in range(0, lead[0], rows):
            yield (slice(start, start + rows),)
        return
    for row in range(lead[0]):
        for rest in anchor_chunks(lead[1:], chunk):
            yield (slice(row, row + 1), *rest)


def _weighted_grad(z: Tensor, p: Tensor | None, ids: Tensor, coef: Tensor, soft_weight: float,
                   hard_weight: float) -> Tensor:
    """``(c.., K, V_d)`` fp32 ``coef · ∂ℓ/∂z`` of one chunk, ``∂ℓ/∂z = soft (q Σp − p) + hard (q − e_y)``: q scaled
    once in place, p subtracted, e_y scattered (one chunk-sized tensor)."""
    g = z.float().softmax(-1)  # (c.., K, V_d) q
    scale = hard_weight * coef
    if soft_weight:
        scale = scale + soft_weight * coef * p.sum(-1)
    g.mul_(scale.unsqueeze(-1))
    if soft_weight:
        g.addcmul_(p, (soft_weight * coef).unsqueeze(-1), value=-1.0)
    if hard_weight:
        g.scatter_add_(-1, ids.clamp_min(0).unsqueeze(-1), -(hard_weight * coef).unsqueeze(-1))
    return g


class _ChunkedImitation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, probs, ids, imit, soft_weight, hard_weight, chunk):  # noqa: D102
        lead = tuple(logits.shape[:-2])
        out = torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)  # (..., K)
        for index in anchor_chunks(lead, chunk):
            z = logits[index].float()  # (c.., K, V_d)
            lse = z.logsumexp(-1)  # (c.., K)
            per_pos = torch.zeros_like(lse)
            if soft_weight:  # -Σ p (z - lse) = lse Σp - Σ p z
                p = probs[index]
                per_pos += soft_weight * (lse * p.sum(-1) - torch.einsum("...v,...v->...", p, z))
            if hard_weight:  # -(z_y - lse)
                per_pos += hard_weight * (lse - z.gather(-1, ids[index].clamp_min(0).unsqueeze(-1)).squeeze(-1))
            out[index] = torch.where(imit[index], per_pos, torch.zeros_like(per_pos))
        ctx.save_for_backward(logits, probs, ids, imit)
        ctx.weights, ctx.chunk = (soft_weight, hard_weight), chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        logits, probs, ids, imit = ctx.saved_tensors
        soft_weight, hard_weight = ctx.weights
        grad = torch.empty_like(logits)  # (..., K, V_d) in the logits' dtype
        for index in anchor_chunks(tuple(logits.shape[:-2]), ctx.chunk):
            coef = torch.where(imit[index], grad_out[index].float(), 0.0)  # (c.., K) dL/dℓ, 0 off the mask
            grad[index] = _weighted_grad(logits[index], probs[index] if soft_weight else None, ids[index], coef,
                                         soft_weight, hard_weight)
        return grad, None, None, None, None, None, None


def chunked_imitation(
    draft_logits: Tensor,
    target_probs: Tensor | None,
    target_ids: Tensor,
    imit: Tensor,
    soft_weight: float,
    hard_weight: float,
    chunk: int,
) -> Tensor:
    """``(..., K)`` fp32 unweighted imitation loss per draft position, 0 off ``imit``; differentiable in the logits.

    Args:
        draft_logits: ``(..., K, V_d)`` (grad), any float dtype.
        target_probs: ``(..., K, V_d)`` fp32 target distribution on the draft vocab (may be a strided view); only read
            when ``soft_weight`` (None then allowed).
        target_ids: ``(..., K)`` int64 target argmax as draft ids (-1 outside the draft vocab: masked by ``imit``).
        imit: ``(..., K)`` bool imitation positions.
        soft_weight: weight of the soft CE (0 = off).
        hard_weight: weight of the hard CE on ``target_ids`` (0 = off).
        chunk: anchors (flat leading positions) per chunk, >= 1.
    """
    if chunk < 1:
        raise ValueError(f"imitation chunk must be >= 1 anchor, got {chunk}")
    if soft_weight and target_probs is None:
        raise ValueError("soft_weight > 0 needs the target probabilities")
    probs = target_probs if soft_weight else draft_logits.new_empty(0)  # empty: never read
    return _ChunkedImitation.apply(draft_logits, probs, target_ids, imit.bool(), float(soft_weight),
                                   float(hard_weight), int(chunk))


@torch.no_grad()
def imitation_grad_norm(
    draft_logits: Tensor,
    target_probs: Tensor | None,
    target_ids: Tensor,
    coef: Tensor,
    soft_weight: float,
    hard_weight: float,
    chunk: int,
) -> Tensor:
    """``()`` fp32 ``‖∂/∂z Σ coef·ℓ‖``: the norm of the weighted imitation term's gradient on the draft logits, a chunk
    of anchors at a time (the gradient itself is never whole: at DFlash's full vocab it would be M·K·V fp32).

    Args:
        draft_logits: ``(..., K, V_d)``.
        target_probs: ``(..., K, V_d)`` fp32 (read only when ``soft_weight``).
        target_ids: ``(..., K)`` int64 draft ids of the target argmax.
        coef: ``(..., K)`` fp32 weight of each position's ``ℓ`` in the term (0 off the imitation mask).
        soft_weight: soft CE weight.
        hard_weight: hard CE weight.
        chunk: anchors per chunk, >= 1.
    """
    total = torch.zeros((), dtype=torch.float32, device=draft_logits.device)
    for index in anchor_chunks(tuple(draft_logits.shape[:-2]), chunk):
        p = target_probs[index] if soft_weight else None
        total += _weighted_grad(draft_logits[index], p, target_ids[index], coef[index].float(), soft_weight,
                                hard_weight).square().sum()
    return total.sqrt()
