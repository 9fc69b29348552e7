"""VAT losses (docs/vat_losses.md, §5): imitation losses, fixed and verification-adaptive weights, verification-head BCE,
expert-union penalty, and the combined objective.

Pure functions of tensors: no model, no I/O. Layout as in :mod:`vat.verify`: per anchor, draft positions
``k = 0..K-1`` (0-indexed; the papers' ``k = 1..K``), tensors ``(..., K)`` / ``(..., K, V_d)`` with ``valid (..., K)``.

Stop-gradient: verification outcomes (accept, k*, survival), the adaptive weights, the target distribution, the
anchor routing and the affinity table. Gradients flow into the draft logits (imitation terms, union penalty) and
the verification-head logits (BCE). Every metric is returned as a SUM (``X_sum`` / ``X_count``), so a distributed
SUM all-reduce followed by :func:`finalize_metrics` is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from vat.errors import VatError
from vat.imitation import HeadLogits, chunked_imitation, imitation_grad_norm
from vat.union_scale import UNION_SCALE_MAX, UnionScale, batch_norms, effective_lambda
from vat.verify import ACCEPTANCE_RULES, TargetDist, VerificationResult, simulate_verification

DRAFTER_KINDS = ("eagle3", "dflash")
UNION_NORMS = ("grad_ratio", "none")
IMITATION_NORMS = ("anchors", "weight_sum")


# ----------------------------------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------------------------------


def eagle3_schedule(K: int, decay: float = 0.8, device: torch.device | None = None) -> Tensor:
    """EAGLE-3 base weights ``w_k = decay**k``, k = 0..K-1 (``0.8^{j-1}`` for 1-indexed j). ``(K,)`` fp32."""
    return decay ** torch.arange(K, dtype=torch.float32, device=device)


def dflash_schedule(K: int, gamma: float = 7.0, device: torch.device | None = None) -> Tensor:
    """DFlash base weights ``w_k = exp(-k / gamma)``, k = 0..K-1 (``exp(-(j-1)/γ)`` for 1-indexed j). ``(K,)`` fp32."""
    return torch.exp(-torch.arange(K, dtype=torch.float32, device=device) / gamma)


def default_dflash_gamma(block_size: int) -> float:
    """γ = 7 for block 16, scaled linearly with the block size (3.5 for block 8)."""
    return 7.0 * block_size / 16.0


def adaptive_weight_matrix(base: Tensor, prefix_only: bool = False) -> Tensor:
    """``M[j, k]`` = the adaptive weight of position k (0-indexed) when the first rejection is ``k* = j + 1``.

    ``M[j, k] = 1`` for ``k <= j`` (positions up to and including k*), else ``base[k - j]`` = w_base(k - k* + 1) in
    1-indexed terms, or 0 with ``prefix_only``.

    Args:
        base: ``(K,)`` base schedule, ``base[0] = 1``.
        prefix_only: ablation: zero weight after k*.

    Returns:
        ``(K + 1, K)`` fp32.
    """
    K = base.numel()
    j = torch.arange(K + 1, device=base.device).unsqueeze(1)  # (K+1, 1)
    k = torch.arange(K, device=base.device).unsqueeze(0)  # (1, K)
    after = base.float()[(k - j).clamp(0, K - 1)]  # (K+1, K)
    if prefix_only:
        after = torch.zeros_like(after)
    return torch.where(k <= j, torch.ones_like(after), after)


@torch.no_grad()
def adaptive_weights(kstar: Tensor, base: Tensor, *, prefix_only: bool = False) -> Tensor:
    """Verification-adaptive weights (stop-gradient).

    ``ŵ_k = 1`` for 1-indexed ``k <= k*`` (the rejection position itself keeps weight 1), ``ŵ_k = w_base(k - k* + 1)``
    for ``k > k*``. Never zero in the default path (``w_base > 0``); ``prefix_only`` (ablation) zeroes ``k > k*``.

    Args:
        kstar: ``(...,)`` int64 first rejection (1-indexed, ``K + 1`` if none), or ``(..., K + 1)`` float
            distribution of k* (from :func:`vat.verify.kstar_distribution`): then the weights are its expectation.
        base: ``(K,)`` base schedule.
        prefix_only: ablation flag.

    Returns:
        ``(..., K)`` fp32, ``requires_grad=False``.
    """
    M = adaptive_weight_matrix(base, prefix_only)  # (K+1, K)
    if kstar.is_floating_point():
        return kstar.float() @ M  # (..., K+1) @ (K+1, K)
    return M[(kstar.long() - 1).clamp(0, base.numel())]  # (..., K)


# ----------------------------------------------------------------------------------------------------------------------
# imitation terms
# ----------------------------------------------------------------------------------------------------------------------


def soft_ce(draft_logits: Tensor, target_probs: Tensor) -> Tensor:
    """Soft cross-entropy ``-Σ_v p(v) log q(v)`` against the target distribution on the draft vocab (renormalised).

    Args:
        draft_logits: ``(..., V_d)``.
        target_probs: ``(..., V_d)`` fp32, sums to 1 (``TargetDist.probs``).

    Returns:
        ``(...,)`` fp32 per position (unmasked).
    """
    return -(target_probs.float() * draft_logits.float().log_softmax(-1)).sum(-1)


def hard_ce(draft_logits: Tensor, target_ids: Tensor) -> Tensor:
    """Hard cross-entropy ``-log q(y)`` on the target's argmax mapped to draft ids.

    Args:
        draft_logits: ``(..., V_d)``.
        target_ids: ``(...,)`` int64 draft ids; ``-1`` (outside the draft vocab) gives 0.

    Returns:
        ``(...,)`` fp32 per position.
    """
    logq = draft_logits.float().log_softmax(-1)  # (..., V_d)
    nll = -logq.gather(-1, target_ids.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # (...,)
    return torch.where(target_ids >= 0, nll, torch.zeros_like(nll))


# ----------------------------------------------------------------------------------------------------------------------
# verification head
# ----------------------------------------------------------------------------------------------------------------------


def _vh_bce_sums(vh_logits: Tensor, survival: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor]:
    bce = F.binary_cross_entropy_with_logits(vh_logits.float(), survival.detach().float(), reduction="none")  # (..., K)
    if valid is None:
        return bce.sum(), torch.tensor(float(bce.numel()), device=bce.device)
    validf = valid.float()
    return (bce * validf).sum(), validf.sum()


def vh_bce(vh_logits: Tensor, survival: Tensor, valid: Tensor | None = None) -> Tensor:
    """Verification-head loss: mean BCE-with-logits of ``v̂ = sigmoid(vh_logits)`` against the survival ``v``.

    Gradients flow into ``vh_logits`` (and from there into the draft body); ``v`` is a stop-gradient target (0/1, or
    a probability for expected acceptance).

    Args:
        vh_logits: ``(..., K)`` pre-sigmoid verification-head outputs.
        survival: ``(..., K)`` survival targets (``VerificationResult.survival``).
        valid: ``(..., K)`` bool; None = all valid.

    Returns:
        ``()`` fp32 mean over valid positions (0 if there are none).
    """
    total, count = _vh_bce_sums(vh_logits, survival, valid)
    return total / count.clamp_min(1.0)


@torch.no_grad()
def binary_auc(scores: Tensor, labels: Tensor) -> float:
    """Exact ROC AUC by ranks: P(score_pos > score_neg) + ½ P(tie), over all (positive, negative) pairs.

    Soft labels ``y ∈ [0, 1]`` count an element as positive with weight y and negative with weight ``1 - y`` (pairs
    of an element with itself excluded); for 0/1 labels this is the usual Mann–Whitney statistic.

    Args:
        scores: ``(N,)`` (any shape; flattened).
        labels: ``(N,)`` bool or float in [0, 1].

    Returns:
        The AUC, or ``nan`` when there is no (positive, negative) pair.
    """
    s = scores.detach().reshape(-1).double().cpu()
    y = labels.detach().reshape(-1).double().cpu()
    if s.numel() == 0:
        return float("nan")
    order = torch.argsort(s)
    s, y = s[order], y[order]
    _, inverse, counts = torch.unique_consecutive(s, return_inverse=True, return_counts=True)
    G = counts.numel()
    pos_g = torch.zeros(G, dtype=torch.float64).index_add_(0, inverse, y)  # (G,) positive weight per tie group
    neg_g = torch.zeros(G, dtype=torch.float64).index_add_(0, inverse, 1.0 - y)  # (G,)
    self_g = torch.zeros(G, dtype=torch.float64).index_add_(0, inverse, y * (1.0 - y))  # (G,) self pairs
    neg_below = torch.cumsum(neg_g, 0) - neg_g  # (G,) negative weight with strictly lower scores
    num = (pos_g * neg_below).sum() + 0.5 * (pos_g * neg_g - self_g).sum()
    den = pos_g.sum() * neg_g.sum() - self_g.sum()
    return float(num / den) if den > 0 else float("nan")


# ----------------------------------------------------------------------------------------------------------------------
# expert-union penalty (docs/vat_losses.md)
# ----------------------------------------------------------------------------------------------------------------------


class _AffinityMix(torch.autograd.Function):
    """``a[i] = Σ_j w[i, j] · table[idx[i, j]]`` without materialising the ``(M, m, L', E)`` gathered rows."""

    @staticmethod
    def forward(ctx: Any, weights: Tensor, idx: Tensor, table: Tensor) -> Tensor:  # (M, m), (M, m), (V, L, E)
        out = weights.new_zeros(weights.shape[0], *table.shape[1:])  # (M, L, E)
        for j in range(weights.shape[1]):  # top-m candidates (<= 8), not positions
            out.add_(weights[:, j, None, None] * table[idx[:, j]].float())  # a compact (fp16) table: rows in fp32
        ctx.save_for_backward(idx, table)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None, None]:
        idx, table = ctx.saved_tensors
        grad_w = torch.stack(
            [(grad_out * table[idx[:, j]].float()).sum((-2, -1)) for j in range(idx.shape[1])], dim=-1
        )  # (M, m)
        return grad_w, None, None


def expected_expert_use(q_draft: Tensor, affinity: Tensor, top_m: int = 8, *, is_logits: bool = False) -> Tensor:
    """Expected expert use of each draft step: ``a = Σ_{v ∈ top-m(q)} q̃(v) A[v]``.

    q̃ is q renormalised over its top-m candidates; gradients reach q (only at those candidates), never the table.

    Args:
        q_draft: ``(..., K, V_d)`` draft probabilities (or logits with ``is_logits``: softmax over the top-m logits
            equals the renormalised top-m probabilities, without a full-vocab softmax in the graph).
        affinity: ``(V_d, L', E)`` table, ``A[v, l, e] = P(e ∈ top-k at layer l | input token v)``.
        top_m: candidates per step.
        is_logits: ``q_draft`` holds logits.

    Returns:
        ``(..., K, L', E)`` fp32 in [0, 1].
    """
    lead, Vd = q_draft.shape[:-1], q_draft.shape[-1]
    m = min(top_m, Vd)
    vals, idx = q_draft.float().reshape(-1, Vd).topk(m, dim=-1)  # (M, m)
    if is_logits:
        w = vals.softmax(-1)  # (M, m)
    else:
        w = vals / vals.sum(-1, keepdim=True).clamp_min(1e-30)  # (M, m)
    table = affinity.detach() if affinity.dtype in (torch.float16, torch.bfloat16) else affinity.detach().float()
    a = _AffinityMix.apply(w, idx, table)  # (M, L', E) fp32
    return a.reshape(*lead, *affinity.shape[1:])


def soft_union(a: Tensor, anchor_routing: Tensor, valid: Tensor | None = None) -> Tensor:
    """Soft expert union of a verification window per layer.

    ``U_l = Σ_e [1 - (1 - r_{l,e}) Π_k (1 - a_{k,l,e})]``; invalid positions contribute nothing (``a_k := 0``).

    Args:
        a: ``(..., K, L', E)`` expected expert use per draft step.
        anchor_routing: ``(..., L', E)`` the anchor (root) token's actual routing, 0/1.
        valid: ``(..., K)`` bool; None = all valid.

    Returns:
        ``(..., L')`` fp32, in experts (between ``Σ_e r`` and E).
    """
    if valid is not None:
        a = a * valid.float()[..., None, None]  # (..., K, L', E)
    miss = torch.prod(1.0 - a, dim=-3)  # (..., L', E): probability that no draft step uses e
    return (1.0 - (1.0 - anchor_routing.float()) * miss).sum(-1)


def union_penalty(union: Tensor, num_experts: int, anchor_valid: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``L_union = mean_{t,l} U_{t,l} / E`` over valid anchors.

    Args:
        union: ``(..., L')`` from :func:`soft_union`.
        num_experts: E.
        anchor_valid: ``(...,)`` bool; None = all anchors.

    Returns:
        ``(penalty (), union_sum (), union_count ())``: the sums (in experts, over anchors × layers) for ``union_sim``.
    """
    L = union.shape[-1]
    if anchor_valid is None:
        total = union.sum()
        count = torch.tensor(float(union.numel()), device=union.device)
    else:
        total = (union * anchor_valid.float().unsqueeze(-1)).sum()
        count = anchor_valid.float().sum() * L
    penalty = total / (count.clamp_min(1.0) * num_experts)
    return penalty, total.detach(), count


def routing_onehot(topk_ids: Tensor, num_experts: int) -> Tensor:
    """Captured routing as a 0/1 expert mask per position.

    For the union window of EAGLE-3 anchor t the root token is ``t + 1`` (shift by one, zero-pad the end); for a
    DFlash block it is the anchor itself.

    Args:
        topk_ids: ``(L', B, T, k)`` int64 executed expert ids; negative ids (dropped slots) are ignored.
        num_experts: E.

    Returns:
        ``(B, T, L', E)`` fp32.
    """
    L, B, T, _ = topk_ids.shape
    out = torch.zeros(L, B, T, num_experts + 1, dtype=torch.float32, device=topk_ids.device)
    ids = torch.where(topk_ids < 0, torch.full_like(topk_ids, num_experts), topk_ids).long()
    out.scatter_(-1, ids, 1.0)
    return out[..., :num_experts].permute(1, 2, 0, 3)  # (B, T, L', E)


def ttt_anchor_routing(topk_ids: Tensor, num_experts: int) -> Tensor:
    """Routing of the root token of each EAGLE-3 anchor's verification window.

    At anchor t the verification block is ``[x_{t+1}, d_1 .. d_K]``; its root routing is the one captured when the
    target read ``x_{t+1}``, i.e. position ``t + 1`` (zeros past the end).

    Args:
        topk_ids: ``(L', B, T, k)`` executed expert ids.
        num_experts: E.

    Returns:
        ``(B, T, L', E)`` fp32 0/1 (the ``anchor_routing`` of :func:`vat_objective`).
    """
    onehot = routing_onehot(topk_ids, num_experts)  # (B, T, L', E)
    out = torch.zeros_like(onehot)
    out[:, :-1] = onehot[:, 1:]
    return out


# ----------------------------------------------------------------------------------------------------------------------
# objective
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class LossSwitches:
    """The loss switches, mirroring ``cfg.loss`` (:class:`vat.config.LossConfig`) after the method preset.

    Every term is a switch: weight 0 = off; ``adaptive_weights=False`` = the base schedule.
    """

    soft_weight: float = 1.0  # soft CE against the target distribution on the draft vocab
    hard_weight: float = 0.0  # hard CE on the target's argmax (mapped to draft ids)
    adaptive_weights: bool = False  # verification-adaptive weighting
    prefix_only: bool = False  # ablation: zero weight after k* (uses k* even when adaptive_weights is off)
    vh_weight: float = 0.0  # beta, verification-head BCE
    union_weight: float = 0.0  # lambda, expert-union penalty
    union_norm: str = "grad_ratio"  # grad_ratio: lambda = union/imitation gradient ratio on the logits | none: raw
    union_top_m: int = 8  # candidates per draft step in the expected expert use
    union_scale_max: float = UNION_SCALE_MAX  # bound on the grad_ratio scale s (inf = unbounded)
    acceptance: str = "greedy"  # greedy | expected | sampled
    decay: float = 0.8  # EAGLE-3 base weight decay**k
    dflash_gamma: float | None = None  # DFlash base weight exp(-k/gamma); None = 7 * block_size / 16
    kind: str = "eagle3"  # eagle3 | dflash: which base schedule
    imitation_norm: str = "anchors"  # anchors: Σ_k over slots, mean over anchors (VAT) | weight_sum: Σ w ℓ / Σ w (DFlash)
    imitation_chunk_mb: float | None = None  # fp32 MiB per chunk of the imitation term (vat.imitation); None = autograd

    def __post_init__(self) -> None:
        if self.acceptance not in ACCEPTANCE_RULES:
            raise VatError(f"loss.acceptance must be one of {list(ACCEPTANCE_RULES)}, got `{self.acceptance}`")
        if self.kind not in DRAFTER_KINDS:
            raise VatError(f"drafter kind must be one of {list(DRAFTER_KINDS)}, got `{self.kind}`")
        if self.union_top_m < 1:
            raise VatError(f"loss.union_top_m must be >= 1, got {self.union_top_m}")
        if self.union_norm not in UNION_NORMS:
            raise VatError(f"loss.union_norm must be one of {list(UNION_NORMS)}, got `{self.union_norm}`")
        if not self.union_scale_max > 0:
            raise VatError(f"loss.union_scale_max must be > 0 (null = the default bound), got {self.union_scale_max}")
        if self.imitation_chunk_mb is not None and not self.imitation_chunk_mb > 0:
            raise VatError(f"loss.imitation_chunk_mb must be > 0 (null = unchunked), got {self.imitation_chunk_mb}")
        if self.imitation_norm not in IMITATION_NORMS:
            raise VatError(f"loss.imitation_norm must be one of {list(IMITATION_NORMS)}, got `{self.imitation_norm}`")

    @classmethod
    def from_config(cls, loss_cfg: Any, kind: str = "eagle3", block_size: int | None = None) -> LossSwitches:
        """Build from ``cfg.loss`` (nulls read as off) and the drafter kind; γ defaults from ``block_size``."""
        gamma = loss_cfg.dflash_gamma
        if gamma is None and kind == "dflash":
            gamma = default_dflash_gamma(block_size or 16)
        return cls(
            soft_weight=float(loss_cfg.soft_weight or 0.0),
            hard_weight=float(loss_cfg.hard_weight or 0.0),
            adaptive_weights=bool(loss_cfg.adaptive_weights),
            prefix_only=bool(loss_cfg.prefix_only),
            vh_weight=float(loss_cfg.vh_weight or 0.0),
            union_weight=float(loss_cfg.union_weight or 0.0),
            union_norm=str(getattr(loss_cfg, "union_norm", "grad_ratio")),
            union_top_m=int(loss_cfg.union_top_m),
            union_scale_max=float(getattr(loss_cfg, "union_scale_max", None) or UNION_SCALE_MAX),
            acceptance=str(loss_cfg.acceptance),
            decay=float(loss_cfg.decay),
            dflash_gamma=None if gamma is None else float(gamma),
            kind=kind,
            imitation_norm=str(getattr(loss_cfg, "imitation_norm", None) or "anchors"),
            imitation_chunk_mb=(None if getattr(loss_cfg, "imitation_chunk_mb", None) is None
                                else float(loss_cfg.imitation_chunk_mb)),
        )

    def base_weights(self, K: int, device: torch.device | None = None) -> Tensor:
        """``(K,)`` fp32 base schedule of this drafter kind."""
        if self.kind == "dflash":
            return dflash_schedule(K, self.dflash_gamma or default_dflash_gamma(K + 1), device)
        return eagle3_schedule(K, self.decay, device)


def vat_objective(
    draft_logits: Tensor | HeadLogits,
    target: TargetDist,
    valid: Tensor,
    switches: LossSwitches,
    *,
    vh_logits: Tensor | None = None,
    imitation_mask: Tensor | None = None,
    affinity: Tensor | None = None,
    anchor_routing: Tensor | None = None,
    verification: VerificationResult | None = None,
    generator: torch.Generator | None = None,
    union_anchors: Tensor | None = None,
    union_scale: UnionScale | None = None,
    measure_pull: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The full training objective, on the VAT paper's scale.

    ``L = (1/N) Σ_anchors Σ_k ŵ_k (soft_weight·ℓ_soft + hard_weight·ℓ_hard) + vh_weight·L_VH + λ·s·L_union``:
    the imitation term is summed over draft positions and averaged over the N anchors that have an imitation
    position (SpecForge's Σ_k w_k·mean_t ℓ and the paper's per-anchor sum), so ``vh_weight = 1`` is the paper's β.
    With ``imitation_norm = weight_sum`` (the DFlash recipe) the imitation term is instead ``Σ ŵ ℓ / Σ ŵ`` over every
    imitation position (a weighted mean; N is replaced by the weight sum).
    With ``union_norm = grad_ratio`` the stop-gradient scale s makes the union term's gradient on the batch's draft
    logits λ times the imitation term's, whatever the target's layers, experts and top-k and however many anchors
    the union term samples (both norms rescaled from the sample to the batch, :func:`vat.union_scale.batch_norms`):
    with ``union_scale`` s is that state's (0 before the affinity table is informative, then measured over a warm-up
    and frozen, :class:`vat.union_scale.UnionScale`), without it s is this call's own ratio; either way s never
    exceeds ``switches.union_scale_max`` (a guard: a near-zero union gradient is noise, not a direction). With
    ``none`` s = 1 and ``L_union = mean U / E``.

    Args:
        draft_logits: ``(..., K, V_d)`` draft logits (grad), or :class:`vat.imitation.HeadLogits` (a full-vocabulary
            readout, DFlash's): the imitation term and the simulated verification then run the head a chunk of
            anchors at a time, and only the union term's sampled anchors get whole logits.
        target: :class:`TargetDist` gathered to ``(..., K[, V_d])``.
        valid: ``(..., K)`` bool: the position exists and is loss-masked.
        switches: :class:`LossSwitches`.
        vh_logits: ``(..., K)`` verification-head logits (grad); required when ``vh_weight > 0``; when given with
            ``vh_weight == 0`` the BCE is only logged. Its labels are the survival at observed positions
            (``verification.valid``: censored positions carry no label).
        imitation_mask: ``(..., K)`` bool extra mask for the imitation terms (e.g. data token outside the draft vocab).
        affinity: ``(V_d, L', E)`` affinity table; with ``anchor_routing``, required when ``union_weight > 0``
            (logged only when the weight is 0).
        anchor_routing: ``(..., L', E)`` 0/1 routing of each anchor's root token.
        verification: a precomputed :func:`vat.verify.simulate_verification` result (else computed here).
        generator: RNG for ``acceptance='sampled'``.
        union_anchors: ``(M,)`` int64 flat indices into the leading dims ``...``: the union term (penalty and
            ``union_sim``) uses only these anchors (None = all). Its memory is ``M·K·L'·E``, so large targets sample.
        union_scale: the training run's :class:`vat.union_scale.UnionScale` (fed this call's norms while it warms up);
            None = s from this call alone.
        measure_pull: compute the two gradient norms (for ``union_lambda_eff``) even when s does not need them; the
            trainer measures only on logging steps once s is frozen (each measurement is one more ``(M, K, V_d)``).

    Returns:
        ``(loss (), metrics)``: metrics are detached SUM-reducible tensors — ``loss_k_sum/count (K,)``,
        ``acc_k_sum/count (K,)``, ``cond_acc_k_sum/count (K,)``, ``tau_sim_sum/count ()``, ``weight_sum ()``
        (Σ ŵ over imitation positions), ``imitation_anchors ()``, and when computed ``vh_bce_sum/count ()``,
        ``union_sim_sum/count ()`` (in experts per layer per anchor), ``union_scale_sum/count ()`` (the grad_ratio
        scale s applied), ``union_scale_raw_sum/count ()`` (this call's batch-scaled norm ratio, when measured),
        ``union_clamped_sum/count ()`` (1 when the guard binds), ``union_lambda_eff_sum/count ()`` (the union's pull
        ``λ·s·‖∇L_union‖/‖∇L_imit‖``, when measured), ``union_loss_sum/count ()`` (the unscaled ``L_union``) and
        ``objective_sum/count ()``: the
        objective with the union term unscaled, ``imitation + vh + λ·L_union`` — what the trainer logs as ``loss``
        (the optimised one carries ``λ·s·L_union``, s up to ~1e7 for a fresh draft).
    """
    K = draft_logits.shape[-2]
    dev = draft_logits.device
    valid = valid.bool()  # (..., K)
    lead = tuple(range(valid.dim() - 1))
    if verification is None:
        verification = simulate_verification(
            draft_logits, target, valid, acceptance=switches.acceptance, generator=generator
        )
    weights = _imitation_weights(verification, target, valid, switches, imitation_mask, K, dev)

    metrics: dict[str, Tensor] = {}
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    if switches.soft_weight or switches.hard_weight:
        per_pos = _imitation_per_position(draft_logits, target, weights.imit, switches)  # (..., K)
        loss = loss + (weights.wm * per_pos).sum() / weights.denom
        metrics["loss_k_sum"] = per_pos.detach().sum(lead) if lead else per_pos.detach()
        metrics["loss_k_count"] = weights.imit.float().sum(lead) if lead else weights.imit.float()
    metrics["weight_sum"] = weights.weight_sum
    metrics["imitation_anchors"] = weights.anchors
    metrics.update(verification.metrics())

    loss = _add_vh_term(loss, metrics, vh_logits, verification, switches)

    logged: Tensor | None = None  # the objective as logged: the union term without the grad_ratio scale
    if switches.union_weight and (affinity is None or anchor_routing is None):
        raise ValueError("union_weight > 0 needs the affinity table and the anchors' routing")
    if affinity is not None and anchor_routing is not None:
        u = _union_inputs(draft_logits, target, valid, verification, anchor_routing, weights.wm, union_anchors)
        pull = _UnionPull(union_scale, measure_pull, verification.anchor_valid.sum())
        loss, logged = _add_union_term(loss, metrics, u, affinity, switches, weights.denom, pull)
    metrics["objective_sum"] = (logged if logged is not None else loss.detach()).float()
    metrics["objective_count"] = torch.ones((), device=dev)
    return loss, metrics


class _ImitationWeights(NamedTuple):
    """The stop-gradient position weights of the imitation term (see :func:`_imitation_weights`)."""

    imit: Tensor  # (..., K) bool: imitation positions (valid, target argmax in the draft vocab, extra mask)
    wm: Tensor  # (..., K) adaptive or base weights times the imitation mask
    weight_sum: Tensor  # () Σ ŵ over imitation positions
    anchors: Tensor  # () N: anchors with at least one imitation position
    denom: Tensor  # () the imitation term's divisor (N, or the weight sum), clamped positive


@torch.no_grad()
def _imitation_weights(
    verification: VerificationResult,
    target: TargetDist,
    valid: Tensor,
    switches: LossSwitches,
    imitation_mask: Tensor | None,
    K: int,
    dev: torch.device,
) -> _ImitationWeights:
    """Position weights ŵ (adaptive from k*, or the base schedule), the imitation mask and the term's divisor."""
    base = switches.base_weights(K, dev)  # (K,)
    if switches.adaptive_weights or switches.prefix_only:
        w = adaptive_weights(verification.kstar_probs, base, prefix_only=switches.prefix_only)  # (..., K)
    else:
        w = base.expand(valid.shape)  # (..., K)
    imit = valid & (target.argmax_draft >= 0)  # (..., K)
    if imitation_mask is not None:
        imit = imit & imitation_mask.bool()
    wm = w * imit.float()  # (..., K)
    weight_sum = wm.sum()
    anchors = imit.any(-1).float().sum()  # N: anchors with at least one imitation position
    if switches.imitation_norm == "weight_sum":  # the imitation term's divisor
        denom = weight_sum.clamp_min(1e-6)
    else:
        denom = anchors.clamp_min(1.0)
    return _ImitationWeights(imit, wm, weight_sum, anchors, denom)


def _chunk_anchors(draft_logits: Tensor | HeadLogits, switches: LossSwitches) -> int:
    """Anchors per chunk: ``imitation_chunk_mb`` MiB of fp32 ``(K, V_d)`` rows each (all anchors when None)."""
    K, Vd = draft_logits.shape[-2:]
    if switches.imitation_chunk_mb is None:
        return max(1, math.prod(draft_logits.shape[:-2]))
    return max(1, int(switches.imitation_chunk_mb * 2**20 // (K * Vd * 4)))


def _imitation_per_position(draft_logits: Tensor | HeadLogits, target: TargetDist, imit: Tensor,
                            switches: LossSwitches) -> Tensor:
    """``(..., K)`` unweighted imitation loss ``soft_weight·ℓ_soft + hard_weight·ℓ_hard``, 0 off the imitation mask:
    a chunk of anchors at a time (:func:`vat.imitation.chunked_imitation`, ``imitation_chunk_mb`` of fp32 per chunk)
    or, with ``imitation_chunk_mb`` None, through autograd (the reference)."""
    if switches.imitation_chunk_mb is not None:
        return chunked_imitation(draft_logits, target.probs, target.argmax_draft, imit, switches.soft_weight,
                                 switches.hard_weight, _chunk_anchors(draft_logits, switches))
    if isinstance(draft_logits, HeadLogits):
        draft_logits = draft_logits[...]  # the reference materialises the logits
    logq = draft_logits.float().log_softmax(-1)  # (..., K, V_d)
    per_pos = torch.zeros_like(logq[..., 0])  # (..., K)
    if switches.soft_weight:
        per_pos = per_pos + switches.soft_weight * -(target.probs * logq).sum(-1)
    if switches.hard_weight:
        ids = target.argmax_draft.clamp_min(0).unsqueeze(-1)  # (..., K, 1)
        per_pos = per_pos + switches.hard_weight * -logq.gather(-1, ids).squeeze(-1)
    return torch.where(imit, per_pos, torch.zeros_like(per_pos))  # (..., K)


def _add_vh_term(
    loss: Tensor,
    metrics: dict[str, Tensor],
    vh_logits: Tensor | None,
    verification: VerificationResult,
    switches: LossSwitches,
) -> Tensor:
    """``loss`` plus ``vh_weight·L_VH`` (when weighted); the BCE is logged into ``metrics`` whenever ``vh_logits``."""
    if switches.vh_weight and vh_logits is None:
        raise ValueError("vh_weight > 0 needs vh_logits (the drafter's verification head)")
    if vh_logits is not None:
        bce_sum, bce_count = _vh_bce_sums(vh_logits, verification.survival, verification.valid)
        if switches.vh_weight:
            loss = loss + switches.vh_weight * bce_sum / bce_count.clamp_min(1.0)
        metrics["vh_bce_sum"] = bce_sum.detach()
        metrics["vh_bce_count"] = bce_count
    return loss


class _UnionInputs(NamedTuple):
    """The union term's inputs: every anchor, or the ``union_anchors`` subset (leading dims flattened to ``M``)."""

    logits: Tensor  # (..., K, V_d) draft logits
    routing: Tensor  # (..., L', E) anchor routing
    valid: Tensor  # (..., K)
    anchor_valid: Tensor  # (...,)
    target: TargetDist  # fields (..., K[, V_d])
    wm: Tensor  # (..., K) imitation weights (for the grad_ratio scale)


def _union_inputs(
    draft_logits: Tensor | HeadLogits,
    target: TargetDist,
    valid: Tensor,
    verification: VerificationResult,
    anchor_routing: Tensor,
    wm: Tensor,
    union_anchors: Tensor | None,
) -> _UnionInputs:
    """The union term's inputs, restricted to ``union_anchors`` when given (None = all anchors); head logits are
    materialised for those anchors only."""
    if union_anchors is None:
        logits = draft_logits[...] if isinstance(draft_logits, HeadLogits) else draft_logits
        return _UnionInputs(logits, anchor_routing, valid, verification.anchor_valid, target, wm)
    # the union term on a subset of anchors: (N, K, L', E) grows with L'·E. The flat indices are unravelled and each
    # tensor indexed in its own leading dims: the target fields are strided views of the per-position tensors (the
    # TTT layout's windows), which a reshape to (N, K, ...) would copy whole (K x the batch's V_d-wide rows)
    index = torch.unravel_index(union_anchors, tuple(valid.shape[:-1]))  # one (M,) index per leading dim
    return _UnionInputs(
        logits=draft_logits[index],  # (M, K, V_d)
        routing=anchor_routing[index],  # (M, L', E)
        valid=valid[index],  # (M, K)
        anchor_valid=verification.anchor_valid[index],  # (M,)
        target=target.apply(lambda x: x[index]),  # fields (M, K[, V_d])
        wm=wm[index],  # (M, K)
    )


def _add_union_term(
    loss: Tensor,
    metrics: dict[str, Tensor],
    u: _UnionInputs,
    affinity: Tensor,
    switches: LossSwitches,
    denom: Tensor,
    pull: _UnionPull,
) -> tuple[Tensor, Tensor | None]:
    """``loss`` plus ``λ·s·L_union`` (when weighted) and the logged objective (its union term unscaled; None when the
    union is only logged). ``union_*`` metrics go into ``metrics``."""
    dev = u.logits.device
    logged: Tensor | None = None
    with torch.set_grad_enabled(torch.is_grad_enabled() and bool(switches.union_weight)):
        a = expected_expert_use(u.logits, affinity, switches.union_top_m, is_logits=True)  # (..., K, L', E)
        union = soft_union(a, u.routing, u.valid)  # (..., L')
        penalty, u_sum, u_count = union_penalty(union, affinity.shape[-1], u.anchor_valid)
    if switches.union_weight:
        scale = _union_scale(penalty, u, switches, denom, metrics, pull)
        # the logged objective takes the union term unscaled: s is ~1e7 when a fresh draft's union gradient is
        # near zero, which bounds the gradient but would make the logged number meaningless
        logged = loss.detach() + switches.union_weight * penalty.detach()
        loss = loss + switches.union_weight * scale * penalty
        metrics["union_scale_sum"] = scale.detach()
        metrics["union_scale_count"] = torch.ones((), device=dev)
        metrics["union_loss_sum"] = penalty.detach().float()
        metrics["union_loss_count"] = torch.ones((), device=dev)
    metrics["union_sim_sum"] = u_sum
    metrics["union_sim_count"] = u_count
    return loss, logged


class _UnionPull(NamedTuple):
    """How :func:`_union_scale` sets s: the run's state (None = this call alone), whether to measure the norms when
    s does not need them, and the batch's valid anchor count N."""

    state: UnionScale | None
    measure: bool
    anchors: Tensor  # () N


def _union_scale(
    penalty: Tensor, u: _UnionInputs, switches: LossSwitches, denom: Tensor, metrics: dict[str, Tensor],
    pull: _UnionPull,
) -> Tensor:
    """``()`` the stop-gradient scale s of the union term (grad_ratio; else 1), its metrics into ``metrics``."""
    dev = u.logits.device
    one = torch.ones((), device=dev)
    if switches.union_norm != "grad_ratio" or not penalty.requires_grad:
        return one
    state = pull.state
    measured = state is None or state.needs_norms or pull.measure
    if measured:
        imit_norm = imitation_grad_norm(u.logits.detach(), u.target.probs, u.target.argmax_draft, u.wm / denom,
                                        switches.soft_weight, switches.hard_weight, _chunk_anchors(u.logits, switches))
        (g_union,) = torch.autograd.grad(penalty, u.logits, retain_graph=True)
        imit_norm, union_norm = batch_norms(imit_norm, g_union.detach().float().norm(), pull.anchors,
                                            u.anchor_valid.float().sum())
        raw = union_grad_scale(imit_norm, union_norm)
        metrics["union_scale_raw_sum"] = raw.detach()
        metrics["union_scale_raw_count"] = one
    if state is None:
        scale, clamped = raw.clamp_max(switches.union_scale_max), raw > switches.union_scale_max
    else:
        if measured:
            state.observe(imit_norm, union_norm)
        scale, clamped = state.value(dev), state.clamped(dev)
    metrics["union_clamped_sum"] = clamped.float()
    metrics["union_clamped_count"] = one
    if measured:
        metrics["union_lambda_eff_sum"] = effective_lambda(switches.union_weight, scale, imit_norm, union_norm)
        metrics["union_lambda_eff_count"] = one
    return scale


def union_grad_scale(imitation_grad: Tensor, union_grad: Tensor) -> Tensor:
    """``||∇_z L_imit|| / ||∇_z L_union||`` over the same logits (stop-gradient; 0 when the union has no gradient).

    Multiplying the union penalty by this makes λ the ratio of the two gradients' norms on the draft logits: a value
    of λ means the same pull on every target shape (the raw ``U/E`` penalty's gradient scales like top_k/E).
    """
    num = imitation_grad.float().norm()
    den = union_grad.detach().float().norm()
    return torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(den))


def finalize_metrics(metrics: dict[str, Tensor]) -> dict[str, Any]:
    """Turn (all-reduced) metric sums into means: every ``X_sum`` / ``X_count`` pair becomes ``X``.

    Per-step entries ``X_k`` become lists ``[X_0, ..., X_{K-1}]``; a zero count gives ``nan``. Other keys pass through
    as floats.
    """
    out: dict[str, Any] = {}
    for key, val in metrics.items():
        if key.endswith("_count"):
            continue
        if key.endswith("_sum") and key[:-4] + "_count" in metrics:
            name = key[:-4]
            num = val.detach().double()
            den = metrics[name + "_count"].detach().double()
            mean = torch.where(den > 0, num / den.clamp_min(1e-300), torch.full_like(num, math.nan))
            out[name] = mean.tolist() if mean.dim() else float(mean)
        else:
            v = val.detach().double()
            out[key] = v.tolist() if v.dim() else float(v)
    return out
