"""The one interface between a drafter's training forward and the VAT machinery (:mod:`vat.verify`, :mod:`vat.losses`).

Both drafters produce predictions in a ``(B, A, K)`` slot layout: A anchors per row, K draft positions each
(EAGLE-3: every position t is an anchor and slot k is TTT step k; DFlash: A sampled anchors and slot k is block
position k + 1). :class:`DraftSlots` carries those predictions together with what the trainer compares them with,
gathered into the same layout, so the trainer's verification and loss path has no drafter-specific code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from vat.losses import routing_onehot, ttt_anchor_routing
from vat.verify import TargetDist, gather_block_targets, onpolicy_censor, onpolicy_censor_block


@dataclass
class DraftSlots:
    """A batch of draft predictions in the ``(B, A, K)`` slot layout.

    Attributes:
        logits: (B, A, K, V_d) draft logits (grad).
        vh_logits: (B, A, K) verification-head logits (grad), or None without a head.
        target: the target distribution at each slot, fields (B, A, K[, V_d]): what simulated verification compares
            with (the target's argmax, never the data token).
        imitation: the imitation losses' targets (soft: ``target.probs``; hard: ``argmax_draft``), fields like
            ``target``; the same object unless the drafter trains its hard CE on the data token.
        valid: (B, A, K) bool: the slot exists and its predicted token is real and loss-masked.
        anchor_routing: (B, A, L', E) 0/1 routing of the root token of each anchor's verification block; None when
            the target's routing is unknown (a capture without routing: no union term).
        censored: (B, A, K) bool, slots whose simulated verification is not the real one (``loss.onpolicy_chain``), or
            None.
    """

    logits: Tensor
    vh_logits: Tensor | None
    target: TargetDist
    imitation: TargetDist
    valid: Tensor
    anchor_routing: Tensor | None
    censored: Tensor | None


def ttt_slots(
    out, dist: TargetDist, batch: dict[str, Tensor], topk_ids: Tensor | None, num_experts: int, ttt_steps: int,
    onpolicy: bool,
) -> DraftSlots:
    """EAGLE-3: every position is an anchor, step k compares with the target at ``t + 1 + k``.

    Args:
        out: :class:`vat.drafters.eagle3.Eagle3TTTOutput` (B, T, K, ·).
        dist: :class:`TargetDist` of the target forward, fields (B, T, ·).
        batch: ``input_ids``, ``attention_mask``, ``loss_mask`` (B, T).
        topk_ids: (L', B, T, k) executed expert ids of the target forward, or None (routing unknown).
        num_experts: E.
        ttt_steps: K.
        onpolicy: end each chain where the data leaves the target's argmax (``loss.onpolicy_chain``).
    """
    input_ids, attention, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    gathered, valid = dist.gather_ttt(ttt_steps, loss_mask, attention)  # (B, T, K, ·), (B, T, K)
    return DraftSlots(
        logits=out.logits,
        vh_logits=out.vh_logits,
        target=gathered,
        imitation=gathered,
        valid=valid,
        # the verification block of anchor t starts with the root token t+1, whose routing is known exactly
        anchor_routing=ttt_anchor_routing(topk_ids, num_experts) if topk_ids is not None else None,  # (B, T, L', E)
        censored=onpolicy_censor(input_ids, dist.argmax, ttt_steps) if onpolicy else None,
    )


def block_slots(
    out, dist: TargetDist, batch: dict[str, Tensor], topk_ids: Tensor | None, num_experts: int, anchors: Tensor,
    onpolicy: bool,
) -> DraftSlots:
    """DFlash: the sampled anchors, slot k compares with the target at ``anchor + k`` and predicts ``anchor + 1 + k``.

    The hard CE is on the data token ``anchor + 1 + k`` (DFlash's label; on the target's own regenerated data it is
    the target's greedy token); simulated verification compares with the target's argmax as for EAGLE-3.

    Args:
        out: :class:`vat.drafters.dflash.DFlashBlockOutput` (B, N, K, ·).
        dist: :class:`TargetDist` of the target forward over the full vocabulary, fields (B, T, ·).
        batch: ``input_ids``, ``attention_mask``, ``loss_mask`` (B, T).
        topk_ids: (L', B, T, k) executed expert ids, or None (routing unknown).
        num_experts: E.
        anchors: (B, N) anchor positions, ``-1`` = padding.
        onpolicy: censor slots after the data leaves the target's argmax (``loss.onpolicy_chain``).
    """
    input_ids, attention, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    K = out.logits.shape[2]
    gathered, valid = dist.gather_block(anchors, K, loss_mask, attention)  # (B, N, K, ·), (B, N, K)
    labels, _ = gather_block_targets(input_ids, anchors.clamp(min=-1) + 1, K)  # (B, N, K): token anchor + 1 + k
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None]
    # the verification block is [anchor, d_1 ..]: its root is the anchor token, read at the anchor's position
    routing = None
    if topk_ids is not None:
        routing = routing_onehot(topk_ids, num_experts)[rows, anchors.clamp(min=0)]  # (B, N, L', E)
    return DraftSlots(
        logits=out.logits,
        vh_logits=out.vh_logits,
        target=gathered,
        imitation=replace(gathered, argmax_draft=labels),  # the draft vocabulary is the target's: ids coincide
        valid=valid,
        anchor_routing=routing,
        censored=onpolicy_censor_block(input_ids, dist.argmax, anchors, K) if onpolicy else None,
    )
