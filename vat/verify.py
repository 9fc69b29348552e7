"""Simulated verification (docs/vat_losses.md): accept masks, first rejection, survival targets, τ_sim.

Pure functions of tensors: no model, no I/O. Everything here runs under ``torch.no_grad`` — verification outcomes are
labels and weights, never a path for gradients.

Conventions (shared with the drafters and the trainer):

* Per anchor and draft position ``k = 0..K-1`` (0-indexed in code; the papers write ``k = 1..K``) tensors are shaped
  ``(..., K)`` / ``(..., K, V)``: ``(B, T, K, V_d)`` for EAGLE-3 training-time-test steps at every anchor ``t``,
  ``(B, N, K, V_d)`` for DFlash block slots at ``N`` sampled anchors.
* ``valid (..., K)`` bool: the position exists and is loss-masked (its predicted token is an assistant token).
* **Chain rule**: a verification chain stops at its first invalid position, which therefore acts as a rejection:
  ``m_eff = m * valid``, ``k* = min{k : m_eff_k = 0}`` (1-indexed, ``K + 1`` if none), ``v_k = Π_{j≤k} m_eff_j``.
* An anchor is *valid* (counted in τ_sim) iff its first position is valid.
* ``draft_to_target (V_d,)`` int64 holds ABSOLUTE target ids of the draft vocab (EAGLE's ``d2t`` stores offsets:
  pass ``d2t + arange(V_d)``); ``None`` means the draft vocab is the target vocab (DFlash).
* Metrics are returned as global sums (numerator, count) so a distributed SUM all-reduce is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Union

import torch
from torch import Tensor

from vat.imitation import HeadLogits, anchor_chunks

ACCEPTANCE_RULES = ("greedy", "expected", "sampled")


# ----------------------------------------------------------------------------------------------------------------------
# vocab maps and the target distribution
# ----------------------------------------------------------------------------------------------------------------------


def target_to_draft_index(draft_to_target: Tensor, target_vocab_size: int) -> Tensor:
    """The inverse of the draft-vocab map.

    Args:
        draft_to_target: ``(V_d,)`` int64 absolute target id of every draft id (injective).
        target_vocab_size: V, the target vocab size.

    Returns:
        ``(V,)`` int64: the draft id of every target id, ``-1`` where the target id is outside the draft vocab.
    """
    index = torch.full((target_vocab_size,), -1, dtype=torch.long, device=draft_to_target.device)  # (V,)
    index[draft_to_target.long()] = torch.arange(draft_to_target.numel(), device=draft_to_target.device)
    return index


@dataclass
class TargetDist:
    """What simulated verification and the imitation losses need of the target distribution p, per position.

    Built once per target position by :func:`target_dist` (one softmax over the full vocab per position, not one per
    draft step), then gathered to ``(..., K, ·)`` by :meth:`gather_ttt` / :meth:`gather_block` (views for TTT).

    Attributes:
        argmax: ``(...,)`` int64 target-vocab id of argmax p (over the FULL target vocab).
        argmax_draft: ``(...,)`` int64 draft id of that argmax, ``-1`` when it lies outside the draft vocab.
        probs: ``(..., V_d)`` fp32 p restricted to the draft vocab and renormalised (the soft-CE target); None when
            built without it (``target_dist(..., with_probs=False)``: greedy acceptance and no soft CE need only
            the argmax, and a (positions, vocab) fp32 tensor is the largest buffer of a large-vocab step).
        mass: ``(...,)`` fp32 p's total mass on the draft vocab (1 for a full vocab); ``probs * mass`` is p at the
            draft ids, un-renormalised (what acceptance uses: q is 0 outside the draft vocab).
    """

    argmax: Tensor
    argmax_draft: Tensor
    probs: Tensor | None
    mass: Tensor

    def probs_on_draft(self) -> Tensor:
        """``(..., V_d)`` fp32 p at the draft ids, un-renormalised (sums to ``mass``)."""
        if self.probs is None:
            raise ValueError("this TargetDist was built without probabilities (target_dist(..., with_probs=False))")
        return self.probs * self.mass.unsqueeze(-1)

    def apply(self, fn: Callable[[Tensor], Tensor]) -> TargetDist:
        """A new TargetDist with ``fn`` applied to every field present (fields share their leading dims)."""
        return TargetDist(**{f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
                             for f in fields(self)})

    def gather_ttt(
        self, K: int, loss_mask: Tensor | None = None, attention_mask: Tensor | None = None
    ) -> tuple[TargetDist, Tensor]:
        """EAGLE-3 TTT layout: see :func:`gather_ttt_targets`. Fields ``(B, T, ·)`` -> ``(B, T, K, ·)``, views."""
        out = self.apply(lambda x: gather_ttt_targets(x, K)[0])
        return out, ttt_valid(self.argmax.shape, K, loss_mask, attention_mask, self.argmax.device)

    def gather_block(
        self, anchors: Tensor, K: int, loss_mask: Tensor | None = None, attention_mask: Tensor | None = None
    ) -> tuple[TargetDist, Tensor]:
        """DFlash block layout: see :func:`gather_block_targets`. Fields ``(B, T, ·)`` -> ``(B, N, K, ·)``."""
        out = self.apply(lambda x: gather_block_targets(x, anchors, K)[0])
        _, valid = gather_block_targets(self.argmax, anchors, K, loss_mask, attention_mask)
        return out, valid


@torch.no_grad()
def target_dist(
    target_logits: Tensor, draft_to_target: Tensor | None = None, chunk_size: int | None = None,
    with_probs: bool = True,
) -> TargetDist:
    """Summarise target logits for verification and imitation (fp32, no grad).

    Args:
        target_logits: ``(..., V)`` target logits (any float dtype; accumulated in fp32).
        draft_to_target: ``(V_d,)`` int64 absolute target ids of the draft vocab; None = draft vocab is the target's.
        chunk_size: process at most this many positions at a time (bounds the fp32 ``(rows, V)`` transient for
            large vocabs); None = all at once.
        with_probs: also keep ``probs`` (needed by the soft CE and by expected / sampled acceptance); False keeps
            argmax and mass only (``probs`` None).

    Returns:
        A :class:`TargetDist` with leading dims ``...``.
    """
    lead, V = target_logits.shape[:-1], target_logits.shape[-1]
    flat = target_logits.reshape(-1, V)  # (M, V)
    M = flat.shape[0]
    step = M if not chunk_size else max(1, chunk_size)
    t2d = target_to_draft_index(draft_to_target, V) if draft_to_target is not None else None
    parts = []
    for s in range(0, max(M, 1), max(step, 1)):
        logits = flat[s : s + step].float()  # (m, V)
        argmax = logits.argmax(-1)  # (m,)
        if draft_to_target is None:
            probs = logits.softmax(-1) if with_probs else None  # (m, V)
            parts.append((argmax, argmax, probs, torch.ones_like(logits[:, 0])))
            continue
        sub = logits.index_select(-1, draft_to_target.long())  # (m, V_d)
        lse_sub = sub.logsumexp(-1)  # (m,)
        probs = (sub - lse_sub.unsqueeze(-1)).exp() if with_probs else None  # (m, V_d) renormalised on the draft vocab
        mass = (lse_sub - logits.logsumexp(-1)).exp()  # (m,)
        parts.append((argmax, t2d[argmax], probs, mass))
    argmax, argmax_draft, probs, mass = (None if p[0] is None else torch.cat(p, 0) for p in zip(*parts))
    return TargetDist(
        argmax=argmax.reshape(lead),
        argmax_draft=argmax_draft.reshape(lead),
        probs=None if probs is None else probs.reshape(*lead, probs.shape[-1]),
        mass=mass.reshape(lead),
    )


# ----------------------------------------------------------------------------------------------------------------------
# gathering targets into the (anchor, K) layout
# ----------------------------------------------------------------------------------------------------------------------


def ttt_valid(
    shape: tuple[int, ...] | torch.Size,
    K: int,
    loss_mask: Tensor | None = None,
    attention_mask: Tensor | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Validity of EAGLE-3 step k at anchor t: ``(B, T, K)`` bool.

    ``valid[b, t, k]`` iff the predicted token ``t + 2 + k`` exists (``t + 1 + k <= T - 2``), ``loss_mask[b, t+2+k]``
    and ``attention_mask`` at both the anchor ``t`` and ``t + 2 + k``.

    Args:
        shape: ``(B, T)``.
        K: TTT steps.
        loss_mask: ``(B, T)`` 1 on assistant tokens; None = all ones.
        attention_mask: ``(B, T)`` 1 on real tokens; None = all ones.
        device: where to build the mask when both masks are None.
    """
    B, T = shape[0], shape[1]
    if device is None:
        device = (
            loss_mask.device if loss_mask is not None else attention_mask.device if attention_mask is not None else None
        )
    lm = torch.ones(B, T, dtype=torch.bool, device=device) if loss_mask is None else loss_mask.bool()
    am = torch.ones(B, T, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
    token_ok = lm & am  # (B, T): the predicted token at this index is real and loss-masked
    # index t + 2 + k for t in [0, T), k in [0, K): shift by 2, zero-pad to T + K - 1 positions, sliding windows
    padded = torch.zeros(B, T + K - 1, dtype=torch.bool, device=token_ok.device)  # (B, T+K-1)
    if T > 2:
        padded[:, : T - 2] = token_ok[:, 2:]
    valid = padded.unfold(1, K, 1)  # (B, T, K)
    return valid & am.unsqueeze(-1)


def gather_ttt_targets(
    x: Tensor, K: int, loss_mask: Tensor | None = None, attention_mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Gather per-position target tensors into the EAGLE-3 TTT layout (a view: one copy of ``x``, not K).

    Step k at anchor t (0-indexed) compares with the target distribution at index ``t + 1 + k``, which predicts token
    ``t + 2 + k``.

    Args:
        x: ``(B, T, *R)`` per-position tensor, e.g. target logits ``(B, T, V)``, argmax ``(B, T)``.
        K: TTT steps.
        loss_mask: ``(B, T)`` 1 on assistant tokens; None = all ones.
        attention_mask: ``(B, T)`` 1 on real tokens; None = all ones.

    Returns:
        ``(gathered (B, T, K, *R), valid (B, T, K) bool)``; gathered entries past the end are zeros (invalid).
    """
    B, T = x.shape[:2]
    rest = x.shape[2:]
    padded = x.new_zeros(B, T + K - 1, *rest)  # (B, T+K-1, *R)
    if T > 1:
        padded[:, : T - 1] = x[:, 1:]
    gathered = padded.unfold(1, K, 1).movedim(-1, 2)  # (B, T, K, *R), a strided view
    return gathered, ttt_valid((B, T), K, loss_mask, attention_mask, x.device)


def gather_block_targets(
    x: Tensor,
    anchors: Tensor,
    K: int,
    loss_mask: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Gather per-position target tensors into the DFlash block layout.

    Slot k (0-indexed, ``K = block_size - 1``) of the block at ``anchor`` predicts token ``anchor + 1 + k``; its target
    distribution is at index ``anchor + k``.

    Args:
        x: ``(B, T, *R)`` per-position tensor.
        anchors: ``(B, N)`` int64 anchor positions; ``-1`` = padding (all slots invalid).
        K: predicted slots per block.
        loss_mask: ``(B, T)``; None = all ones.
        attention_mask: ``(B, T)``; None = all ones.

    Returns:
        ``(gathered (B, N, K, *R), valid (B, N, K) bool)``; valid iff the anchor is real, the predicted token exists,
        is loss-masked and attended.
    """
    B, T = x.shape[:2]
    dev = x.device
    anchors = anchors.long()
    pos = anchors.unsqueeze(-1) + torch.arange(K, device=dev)  # (B, N, K) index of the target distribution
    gathered = x[torch.arange(B, device=dev)[:, None, None], pos.clamp(0, max(T - 1, 0))]  # (B, N, K, *R)
    lm = torch.ones(B, T, dtype=torch.bool, device=dev) if loss_mask is None else loss_mask.bool()
    am = torch.ones(B, T, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.bool()
    tok = pos + 1  # (B, N, K) predicted token index
    inside = (anchors.unsqueeze(-1) >= 0) & (tok <= T - 1)  # (B, N, K)
    bidx = torch.arange(B, device=dev)[:, None, None]
    tok_c = tok.clamp(0, max(T - 1, 0))
    anc_c = anchors.clamp(0, max(T - 1, 0)).unsqueeze(-1).expand_as(tok)
    valid = inside & lm[bidx, tok_c] & am[bidx, tok_c] & am[bidx, anc_c]
    return gathered, valid


@torch.no_grad()
def onpolicy_censor(input_ids: Tensor, target_argmax: Tensor, K: int) -> Tensor:
    """Positions of the EAGLE-3 TTT layout whose simulated verification is not the real one (``loss.onpolicy_chain``).

    Step k at anchor t is fed the data tokens ``t+2 .. t+1+k`` as its earlier drafts; real verification continues on
    the target's argmax instead. The two agree only while every such data token is the target's argmax, so step k is
    *observed* iff ``input_ids[t+1+j] == argmax[t+j]`` for j = 1..k, and *censored* after the first mismatch: its
    outcome is unknown (neither accepted nor rejected). Step 0 is always observed.

    Args:
        input_ids: ``(B, T)`` data tokens.
        target_argmax: ``(B, T)`` the target's argmax at each position (target vocab; predicts token t + 1).
        K: TTT steps.

    Returns:
        ``(B, T, K)`` bool, True where the step is censored.
    """
    # (B, T, K): the mismatch at index t+1+k; past the end: no mismatch
    mismatch_k, _ = gather_ttt_targets(_argmax_mismatch(input_ids, target_argmax), K)
    return _censor_after_mismatch(mismatch_k)


@torch.no_grad()
def onpolicy_censor_block(input_ids: Tensor, target_argmax: Tensor, anchors: Tensor, K: int) -> Tensor:
    """:func:`onpolicy_censor` for DFlash blocks: slots whose simulated verification is not the real one.

    Slot k of the block at anchor a is compared with the target's argmax at index ``a + k``, which the target computed
    reading the data tokens ``a+1 .. a+k``; real verification reads the accepted drafts there, i.e. the target's own
    argmax chain. Slot k is observed iff ``input_ids[a+1+j] == argmax[a+j]`` for j = 0..k-1 (slot 0 always).

    Args:
        input_ids: ``(B, T)`` data tokens.
        target_argmax: ``(B, T)`` the target's argmax at each position (predicts token t + 1).
        anchors: ``(B, N)`` anchor positions, ``-1`` = padding.
        K: slots per block (``block_size - 1``).

    Returns:
        ``(B, N, K)`` bool, True where the slot is censored.
    """
    mismatch_k, _ = gather_block_targets(_argmax_mismatch(input_ids, target_argmax), anchors, K)  # (B, N, K): at a+k
    return _censor_after_mismatch(mismatch_k)


def _argmax_mismatch(input_ids: Tensor, target_argmax: Tensor) -> Tensor:
    """``(B, T)`` bool: data token i+1 differs from the target's argmax at i (False at the last position)."""
    B, T = input_ids.shape
    mismatch = torch.zeros(B, T, dtype=torch.bool, device=input_ids.device)
    if T > 1:
        mismatch[:, :-1] = input_ids[:, 1:] != target_argmax[:, :-1]
    return mismatch


def _censor_after_mismatch(mismatch_k: Tensor) -> Tensor:
    """``(..., K)`` mismatch of each position -> censored[k] = any mismatch at positions j < k (position 0 never)."""
    earlier = torch.cat([torch.zeros_like(mismatch_k[..., :1]), mismatch_k[..., :-1]], dim=-1)  # shift right by one
    return torch.cummax(earlier.long(), dim=-1).values.bool()  # running OR


# ----------------------------------------------------------------------------------------------------------------------
# accept masks
# ----------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_accept(draft_logits: Tensor, target_argmax_draft: Tensor) -> Tensor:
    """Greedy acceptance ``m = 1[argmax q = argmax p]`` (the target's argmax, not the data token).

    Args:
        draft_logits: ``(..., V_d)`` draft logits over the draft vocab.
        target_argmax_draft: ``(...,)`` draft id of the target's argmax, ``-1`` outside the draft vocab (never
            matched: the draft cannot propose it).

    Returns:
        ``(...,)`` fp32 in {0, 1}.
    """
    return (draft_logits.argmax(-1) == target_argmax_draft).float()


@torch.no_grad()
def expected_accept(q: Tensor, p_on_draft: Tensor) -> Tensor:
    """Expected acceptance of speculative sampling ``α = Σ_v min(p(v), q(v))`` over the target vocab.

    q is zero outside the draft vocab, so the sum runs over draft ids with p un-renormalised.

    Args:
        q: ``(..., V_d)`` draft probabilities.
        p_on_draft: ``(..., V_d)`` target probabilities at the draft ids (un-renormalised).

    Returns:
        ``(...,)`` fp32 in [0, 1].
    """
    return torch.minimum(q.float(), p_on_draft.float()).sum(-1).clamp(0.0, 1.0)


@torch.no_grad()
def sampled_accept(q: Tensor, p_on_draft: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw of speculative sampling: ``d ~ q``, accept with probability ``min(1, p(d) / q(d))``.

    Args:
        q: ``(..., V_d)`` draft probabilities.
        p_on_draft: ``(..., V_d)`` target probabilities at the draft ids (un-renormalised).
        generator: a ``torch.Generator`` on q's device (reproducible draws); None = the global RNG.

    Returns:
        ``(...,)`` fp32 in {0, 1}; its mean over draws is :func:`expected_accept`.
    """
    lead, Vd = q.shape[:-1], q.shape[-1]
    qf = q.float().reshape(-1, Vd)  # (M, V_d)
    if qf.shape[0] == 0:
        return q.new_zeros(lead, dtype=torch.float32)
    d = torch.multinomial(qf, 1, generator=generator)  # (M, 1)
    qd = qf.gather(-1, d).squeeze(-1)  # (M,)
    pd = p_on_draft.float().reshape(-1, Vd).gather(-1, d).squeeze(-1)  # (M,)
    u = torch.rand(qd.shape, generator=generator, device=qd.device)  # (M,)
    return (u * qd < pd).float().reshape(lead)  # u < p/q  <=>  accept w.p. min(1, p/q)


@torch.no_grad()
def position_accept(
    draft_logits: Tensor | HeadLogits, target: TargetDist, acceptance: str, generator: torch.Generator | None = None,
) -> Tensor:
    """``(..., K)`` fp32 per-position acceptance under ``acceptance`` (before the chain rule and the valid mask).

    From :class:`HeadLogits` it is read a chunk of anchors at a time (its ``chunk_mb`` of fp32 ``(K, V)`` logits
    each): the same values as from the materialised logits for ``greedy`` and ``expected``, the same distribution
    (other draws) for ``sampled``.
    """
    if not isinstance(draft_logits, HeadLogits):
        return _accept(draft_logits, target, acceptance, generator)
    lead = tuple(draft_logits.shape[:-2])
    chunk = draft_logits.chunk_anchors()
    m = torch.zeros(draft_logits.shape[:-1], dtype=torch.float32, device=draft_logits.device)  # (..., K)
    for index in anchor_chunks(lead, chunk):
        m[index] = _accept(draft_logits[index], target.apply(lambda x, i=index: x[i]), acceptance, generator)
    return m


def _accept(draft_logits: Tensor, target: TargetDist, acceptance: str, generator: torch.Generator | None) -> Tensor:
    if acceptance == "greedy":
        return greedy_accept(draft_logits, target.argmax_draft)  # (..., K)
    q = draft_logits.float().softmax(-1)  # (..., K, V_d)
    p = target.probs_on_draft()  # (..., K, V_d)
    return expected_accept(q, p) if acceptance == "expected" else sampled_accept(q, p, generator)


# ----------------------------------------------------------------------------------------------------------------------
# chain statistics
# ----------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def survival(accept: Tensor, valid: Tensor | None = None) -> Tensor:
    """Survival ``v_k = Π_{j≤k} m_j · valid_j`` (a chain stops at its first invalid position).

    Args:
        accept: ``(..., K)`` per-position acceptance (0/1, or a probability for expected acceptance).
        valid: ``(..., K)`` bool; None = all valid.

    Returns:
        ``(..., K)`` fp32: 0/1, or the probability that the prefix up to k is accepted.
    """
    m = accept.float() if valid is None else accept.float() * valid.float()  # (..., K)
    return torch.cumprod(m, dim=-1)


@torch.no_grad()
def kstar_distribution(accept: Tensor, valid: Tensor | None = None) -> Tensor:
    """Distribution of the first rejection under independent per-position acceptance.

    ``P(k* = j) = v_{j-1} (1 - m_j)`` for j = 1..K (``v_0 = 1``), ``P(k* = K+1) = v_K``; one-hot for 0/1 acceptance.

    Args:
        accept: ``(..., K)``.
        valid: ``(..., K)`` bool; None = all valid.

    Returns:
        ``(..., K + 1)`` fp32; index j-1 holds ``P(k* = j)``.
    """
    m = accept.float() if valid is None else accept.float() * valid.float()  # (..., K)
    v = torch.cumprod(m, dim=-1)  # (..., K)
    v_prev = torch.cat([torch.ones_like(v[..., :1]), v[..., :-1]], dim=-1)  # (..., K)
    return torch.cat([v_prev * (1.0 - m), v[..., -1:]], dim=-1)  # (..., K+1)


@torch.no_grad()
def first_rejection(accept: Tensor, valid: Tensor | None = None) -> Tensor:
    """First rejection ``k* = min{k : m_k · valid_k = 0}``, 1-indexed, ``K + 1`` if none.

    For probabilistic acceptance this is the most likely k* (the mode of :func:`kstar_distribution`).

    Args:
        accept: ``(..., K)``.
        valid: ``(..., K)`` bool; None = all valid.

    Returns:
        ``(...,)`` int64 in [1, K+1].
    """
    return kstar_distribution(accept, valid).argmax(-1) + 1


@dataclass
class VerificationResult:
    """Outcome of simulated verification for a batch of anchors, plus metric sums.

    Attributes:
        accept: ``(..., K)`` fp32 per-position acceptance m (0/1; α for ``expected``), 0 where invalid. Raw: not
            multiplied by the chain prefix.
        kstar: ``(...,)`` int64 first rejection, 1-indexed, ``K + 1`` if none (mode of ``kstar_probs``).
        kstar_probs: ``(..., K + 1)`` fp32 distribution of k* (one-hot for greedy / sampled).
        survival: ``(..., K)`` fp32 ``v_k`` (the VH target; a probability for ``expected``).
        valid: ``(..., K)`` bool.
        anchor_valid: ``(...,)`` bool, ``valid[..., 0]``.
        tau_sum: ``()`` fp32 Σ over valid anchors of ``1 + Σ_k v_k``.
        anchor_count: ``()`` fp32 number of valid anchors.
        acc_sum, acc_count: ``(K,)`` fp32 Σ m_k and count over valid positions (unconditional acceptance).
        cond_acc_sum, cond_acc_count: ``(K,)`` fp32 Σ v_{k-1} m_k and Σ v_{k-1} over valid positions (acceptance
            given that the prefix survived; weighted by the prefix probability for ``expected``).
    """

    accept: Tensor
    kstar: Tensor
    kstar_probs: Tensor
    survival: Tensor
    valid: Tensor
    anchor_valid: Tensor
    tau_sum: Tensor
    anchor_count: Tensor
    acc_sum: Tensor
    acc_count: Tensor
    cond_acc_sum: Tensor
    cond_acc_count: Tensor

    @property
    def tau_sim(self) -> float:
        """Local τ_sim (for a distributed mean, reduce ``tau_sum`` and ``anchor_count`` first)."""
        return float(self.tau_sum / self.anchor_count.clamp_min(1.0))

    def metrics(self) -> dict[str, Tensor]:
        """Metric sums (all SUM-reducible): ``tau_sim_*``, ``acc_k_*``, ``cond_acc_k_*`` as ``_sum`` / ``_count``."""
        return {
            "tau_sim_sum": self.tau_sum,
            "tau_sim_count": self.anchor_count,
            "acc_k_sum": self.acc_sum,
            "acc_k_count": self.acc_count,
            "cond_acc_k_sum": self.cond_acc_sum,
            "cond_acc_k_count": self.cond_acc_count,
        }


@torch.no_grad()
def simulate_verification(
    draft_logits: Tensor | HeadLogits,
    target: Union[TargetDist, Tensor],
    valid: Tensor | None = None,
    *,
    acceptance: str = "greedy",
    draft_to_target: Tensor | None = None,
    generator: torch.Generator | None = None,
    censored: Tensor | None = None,
) -> VerificationResult:
    """Simulate the target's left-to-right verification of every anchor's K drafted positions.

    Censored positions (``censored``, e.g. from :func:`onpolicy_censor`) have an unknown outcome: they are neither
    accepted nor rejected. They are left out of the survival labels, τ_sim and the acceptance metrics (the returned
    ``valid`` excludes them). For the adaptive weights a chain that survives up to its first censored position c is
    restarted there: ``kstar`` is c (not an observed rejection, only where the base decay restarts), so the weights
    are 1 up to c and ``w_base(k - c + 1)`` after it, the prior's reach probability from the last known point,
    instead of 1 (the upper bound, which pulls VAT toward uniform weights when many positions are censored).

    Args:
        draft_logits: ``(..., K, V_d)`` draft logits over the draft vocab (detached internally), or
            :class:`vat.imitation.HeadLogits` (read a chunk at a time: :func:`position_accept`).
        target: a :class:`TargetDist` with fields ``(..., K[, V_d])`` (e.g. from :meth:`TargetDist.gather_ttt`), or
            raw target logits ``(..., K, V)`` (then ``draft_to_target`` maps the draft vocab into it).
        valid: ``(..., K)`` bool; None = all valid.
        acceptance: ``greedy`` (argmax match), ``expected`` (α = Σ min(p, q)) or ``sampled`` (one Bernoulli draw).
        draft_to_target: ``(V_d,)`` int64 absolute target ids; only used when ``target`` is raw logits.
        generator: RNG for ``sampled`` (on the logits' device).
        censored: ``(..., K)`` bool, positions whose outcome is unknown (a suffix of each chain); None = none.

    Returns:
        A :class:`VerificationResult` whose ``valid`` is ``valid & ~censored``.
    """
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"unknown acceptance rule {acceptance!r}; one of {ACCEPTANCE_RULES}")
    draft_logits = draft_logits.detach()
    if isinstance(target, Tensor):
        target = target_dist(target, draft_to_target)
    if valid is None:
        valid = torch.ones(draft_logits.shape[:-1], dtype=torch.bool, device=draft_logits.device)
    valid = valid.bool()  # (..., K)
    m = position_accept(draft_logits, target, acceptance, generator)  # (..., K)
    m = m * valid.float()  # (..., K)
    if censored is not None:
        censored = censored.bool()
        valid = valid & ~censored  # observed positions
        # unknown outcome: the chain's known part ends at its first censored position, where the base decay restarts
        m = torch.where(censored, torch.zeros_like(m), m)
    kprobs = kstar_distribution(m)  # (..., K+1)
    if censored is not None:
        m = m * valid.float()  # labels and metrics from observed positions only
    v = torch.cumprod(m, dim=-1)  # (..., K): censored positions are a suffix, so they only zero their own entries
    v_prev = torch.cat([torch.ones_like(v[..., :1]), v[..., :-1]], dim=-1)  # (..., K)
    validf = valid.float()
    anchor_valid = valid[..., 0]  # (...,)
    lead = tuple(range(m.dim() - 1))
    tau = (1.0 + v.sum(-1)) * anchor_valid.float()  # (...,)
    return VerificationResult(
        accept=m,
        kstar=kprobs.argmax(-1) + 1,
        kstar_probs=kprobs,
        survival=v,
        valid=valid,
        anchor_valid=anchor_valid,
        tau_sum=tau.sum(),
        anchor_count=anchor_valid.float().sum(),
        acc_sum=m.sum(lead) if lead else m.clone(),
        acc_count=validf.sum(lead) if lead else validf,
        cond_acc_sum=v.sum(lead) if lead else v.clone(),  # v_k = v_{k-1} m_k
        cond_acc_count=(v_prev * validf).sum(lead) if lead else v_prev * validf,
    )
