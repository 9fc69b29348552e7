"""The imitation term's per-position loss, a chunk of anchors at a time (the memory-bounded path of the objective).

Per draft position, ``ℓ = soft_weight · (−Σ_v p(v) log q(v)) + hard_weight · (−log q(y))`` with ``q = softmax(z)``
over the draft vocab. Autograd through ``log_softmax`` keeps an fp32 ``(..., K, V_d)`` log-probability tensor and the
product with ``p`` alive until backward; at the shipped recipes' shapes that is 16k tokens x 7 steps x 32k (EAGLE-3)
or 512 blocks x 16 slots x 152k (DFlash) fp32 values per tensor, several GB each. :func:`chunked_imitation` computes
``ℓ`` a chunk of anchors at a time and saves nothing but its inputs; backward recomputes ``softmax(z)`` per chunk and
writes ``∂ℓ/∂z = soft_weight · (q Σp − p) + hard_weight · (q − e_y)`` into one gradient buffer in the logits' dtype.
The transient memory is one chunk's ``(c, K, V_d)`` in fp32. The target fields may be strided views (the TTT layout's
windows): each chunk gathers its own anchors' rows, never the whole view.

Reference: ``vat.losses`` computes the same ``ℓ`` with autograd when ``loss.imitation_chunk_mb`` is null; the two agree in
value and gradient (``tests/test_imitation.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor


def _chunks(lead: tuple[int, ...], chunk: int, device: torch.device) -> Iterator[tuple[Tensor, ...]]:
    """Index tuples over the leading dims ``lead``, ``chunk`` flat anchors each (unravelled, so views need no copy)."""
    total = 1
    for d in lead:
        total *= d
    for start in range(0, total, chunk):
        flat = torch.arange(start, min(total, start + chunk), device=device)
        yield torch.unravel_index(flat, lead)


def _chunk_inputs(inputs: tuple[Tensor, ...], index: tuple[Tensor, ...]) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """One chunk of (logits, probs, ids, imit): fp32 logits (c, K, V_d), fp32 target probs (None when not given),
    draft ids (c, K), imitation mask (c, K)."""
    logits, probs, ids, imit = inputs
    return logits[index].float(), None if probs.numel() == 0 else probs[index].float(), ids[index], imit[index]


class _ChunkedImitation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, probs, ids, imit, soft_weight, hard_weight, chunk):  # noqa: D102
        lead = tuple(logits.shape[:-2])
        out = torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)  # (..., K)
        for index in _chunks(lead, chunk, logits.device):
            z, p, y, mask = _chunk_inputs((logits, probs, ids, imit), index)
            logq = z.log_softmax(-1)  # (c, K, V_d)
            per_pos = torch.zeros_like(logq[..., 0])  # (c, K)
            if soft_weight:
                per_pos = per_pos + soft_weight * -(p * logq).sum(-1)
            if hard_weight:
                per_pos = per_pos + hard_weight * -logq.gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            out[index] = torch.where(mask, per_pos, torch.zeros_like(per_pos))
        ctx.save_for_backward(logits, probs, ids, imit)
        ctx.weights, ctx.chunk, ctx.lead = (soft_weight, hard_weight), chunk, lead
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        logits = ctx.saved_tensors[0]
        soft_weight, hard_weight = ctx.weights
        grad = torch.empty_like(logits)  # (..., K, V_d) in the logits' dtype
        for index in _chunks(ctx.lead, ctx.chunk, logits.device):
            z, p, y, mask = _chunk_inputs(ctx.saved_tensors, index)
            q = z.softmax(-1)  # (c, K, V_d)
            g = torch.zeros_like(q)
            if soft_weight:
                g += soft_weight * (q * p.sum(-1, keepdim=True) - p)
            if hard_weight:
                g += hard_weight * (q - torch.zeros_like(q).scatter_(-1, y.clamp_min(0).unsqueeze(-1), 1.0))
            coef = torch.where(mask, grad_out[index].float(), torch.zeros_like(grad_out[index], dtype=torch.float32))
            grad[index] = (g * coef.unsqueeze(-1)).to(grad.dtype)
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
