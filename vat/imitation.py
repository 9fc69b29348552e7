"""The imitation term's per-position loss, a chunk of anchors at a time (the memory-bounded path of the objective).

Per draft position, ``ℓ = soft_weight · (−Σ_v p(v) log q(v)) + hard_weight · (−log q(y))`` with ``q = softmax(z)``
over the draft vocab. Autograd through ``log_softmax`` keeps an fp32 ``(..., K, V_d)`` log-probability tensor and the
product with ``p`` alive until backward; at the shipped recipes' shapes that is 16k tokens x 7 steps x 32k (EAGLE-3)
or 512 blocks x 16 slots x 152k (DFlash) fp32 values per tensor, several GB each. :func:`chunked_imitation` computes
``ℓ`` a chunk of anchors at a time and saves nothing but its inputs; backward recomputes ``softmax(z)`` per chunk and
writes ``∂ℓ/∂z = soft_weight · (q Σp − p) + hard_weight · (q − e_y)`` into one gradient buffer in the logits' dtype.
The transient memory is one chunk's ``(c, K, V_d)`` in fp32 (two in backward). Chunks are slices of the leading dims,
so the target fields may stay strided views (the TTT layout's windows): nothing copies the whole view.

A drafter that reads out through the target's full-vocabulary LM head (DFlash: 152k columns on Qwen3) hands the loss
:class:`HeadLogits` instead of logits: the normed hidden states and the head's weight. :func:`chunked_imitation` then
runs the head inside each chunk (:class:`_ChunkedHeadImitation`): forward and backward recompute ``hidden @ W^T`` per
chunk, and the gradient reaches the hidden states as ``∂ℓ/∂z · W`` a chunk at a time, so no ``(..., K, V)`` tensor of
the batch (logits, log-probabilities or their gradient) ever exists whole.

Reference: ``vat.losses`` computes the same ``ℓ`` with autograd when ``loss.imitation_chunk_mb`` is null; the two agree in
value and gradient (``tests/test_imitation.py``), and so does the head-inside path with logits materialised from the
same hidden states.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class HeadLogits:
    """``(..., K, V)`` draft logits ``hidden @ weight.T`` kept as their two factors (never materialised whole).

    Consumers take them a chunk of anchors at a time: ``logits[index]`` (a tuple of slices or index tensors over the
    leading dims) is that part's logits, differentiable in ``hidden``; :func:`chunked_imitation` runs the head inside
    its chunks; :func:`vat.verify.simulate_verification` reads acceptance per chunk.

    Attributes:
        hidden: ``(..., K, H)`` the slots' normed hidden states (grad).
        weight: ``(V, H)`` the LM head's weight (the target's, frozen: no gradient reaches it).
        chunk_mb: fp32 MiB of ``(K, V)`` logits per chunk where a consumer has no chunk size of its own (the
            simulated verification); the training loss sets it to ``loss.imitation_chunk_mb``.
    """

    hidden: Tensor
    weight: Tensor
    chunk_mb: float = 256.0

    @property
    def shape(self) -> torch.Size:
        """``(..., K, V)``."""
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def detach(self) -> HeadLogits:
        """The same logits with the hidden states detached."""
        return HeadLogits(self.hidden.detach(), self.weight, self.chunk_mb)

    def chunk_anchors(self) -> int:
        """Anchors per chunk of ``chunk_mb``."""
        K, V = self.shape[-2:]
        return max(1, int(self.chunk_mb * 2**20 // (K * V * 4)))

    def __getitem__(self, index) -> Tensor:
        """``(..., K, V)`` logits of the anchors ``index`` selects, in the head's dtype (differentiable)."""
        return head_logits(self.hidden[index], self.weight)


def head_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """``hidden (..., H) -> (..., V)`` through a frozen LM head (hidden cast to its device and dtype)."""
    return F.linear(hidden.to(device=weight.device, dtype=weight.dtype), weight)


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


def _chunk_loss(z: Tensor, p: Tensor | None, ids: Tensor, imit: Tensor, soft_weight: float,
                hard_weight: float) -> Tensor:
    """``(c.., K)`` fp32 ``ℓ`` of one chunk of logits ``z`` (any dtype), 0 off ``imit``."""
    z = z.float()  # (c.., K, V_d)
    lse = z.logsumexp(-1)  # (c.., K)
    per_pos = torch.zeros_like(lse)
    if soft_weight:  # -Σ p (z - lse) = lse Σp - Σ p z
        per_pos += soft_weight * (lse * p.sum(-1) - torch.einsum("...v,...v->...", p, z))
    if hard_weight:  # -(z_y - lse)
        per_pos += hard_weight * (lse - z.gather(-1, ids.clamp_min(0).unsqueeze(-1)).squeeze(-1))
    return torch.where(imit, per_pos, torch.zeros_like(per_pos))


class _ChunkedImitation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, probs, ids, imit, soft_weight, hard_weight, chunk):  # noqa: D102
        lead = tuple(logits.shape[:-2])
        out = torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)  # (..., K)
        for index in anchor_chunks(lead, chunk):
            out[index] = _chunk_loss(logits[index], probs[index] if soft_weight else None, ids[index], imit[index],
                                     soft_weight, hard_weight)
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


class _ChunkedHeadImitation(torch.autograd.Function):
    """:class:`_ChunkedImitation` with the LM head inside each chunk: inputs are the hidden states and the head."""

    @staticmethod
    def forward(ctx, hidden, weight, probs, ids, imit, soft_weight, hard_weight, chunk):  # noqa: D102
        lead = tuple(hidden.shape[:-2])
        out = torch.zeros(hidden.shape[:-1], dtype=torch.float32, device=hidden.device)  # (..., K)
        for index in anchor_chunks(lead, chunk):
            out[index] = _chunk_loss(head_logits(hidden[index], weight), probs[index] if soft_weight else None,
                                     ids[index], imit[index], soft_weight, hard_weight)
        ctx.save_for_backward(hidden, weight, probs, ids, imit)
        ctx.weights, ctx.chunk = (soft_weight, hard_weight), chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        hidden, weight, probs, ids, imit = ctx.saved_tensors
        soft_weight, hard_weight = ctx.weights
        grad_hidden = torch.empty_like(hidden)  # (..., K, H)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None  # (V, H), only for a trainable head
        for index in anchor_chunks(tuple(hidden.shape[:-2]), ctx.chunk):
            h = hidden[index].to(device=weight.device, dtype=weight.dtype)  # (c.., K, H)
            coef = torch.where(imit[index], grad_out[index].float(), 0.0)  # (c.., K)
            g = _weighted_grad(F.linear(h, weight), probs[index] if soft_weight else None, ids[index], coef,
                               soft_weight, hard_weight).to(weight.dtype)  # (c.., K, V) dℓ/dz
            grad_hidden[index] = (g @ weight).to(device=hidden.device, dtype=hidden.dtype)  # (c.., K, H)
            if grad_weight is not None:
                grad_weight += (g.flatten(0, -2).T @ h.flatten(0, -2)).float()
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None, None, None, None, None, None)


def chunked_imitation(
    draft_logits: Tensor | HeadLogits,
    target_probs: Tensor | None,
    target_ids: Tensor,
    imit: Tensor,
    soft_weight: float,
    hard_weight: float,
    chunk: int,
) -> Tensor:
    """``(..., K)`` fp32 unweighted imitation loss per draft position, 0 off ``imit``; differentiable in the logits.

    Args:
        draft_logits: ``(..., K, V_d)`` (grad), any float dtype; or :class:`HeadLogits` (the head then runs inside
            each chunk and the gradient goes to its hidden states).
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
    if isinstance(draft_logits, HeadLogits):
        probs = target_probs if soft_weight else draft_logits.hidden.new_empty(0)  # empty: never read
        return _ChunkedHeadImitation.apply(draft_logits.hidden, draft_logits.weight, probs, target_ids, imit.bool(),
                                           float(soft_weight), float(hard_weight), int(chunk))
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
