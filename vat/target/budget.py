"""Expert budgeting (MoE-Spec, DESIGN §3): per window, keep only B experts per MoE layer.

Pure tensor functions, applied by the router hook in :mod:`vat.target.routing`:

1. :func:`window_groups` assigns every token of a forward to a budget window (a group id), or -1 (unbudgeted);
2. :func:`budget_sets` picks each window's expert set S per layer: the window's natural union when it fits in B
   (so B >= union leaves the model bit-identical), else the top-B experts by summed routing score;
3. :func:`apply_budget` reroutes (``substitute``) or drops (``truncate``) the out-of-budget slots, keeping each
   family's own weighting rule through its :class:`~vat.target.families.FamilyAdapter`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vat.errors import VatError
from vat.target.families import FamilyAdapter

POLICIES = ("substitute", "truncate")
SCOPES = ("sequence", "batch")


@dataclass
class BudgetSpec:
    """Where and how hard to budget a forward.

    Attributes:
        B: experts kept per MoE layer per window: an int, a list indexed by MoE-layer ordinal, or a mapping
            ``{decoder layer index: B}`` (layers absent from the mapping are not budgeted).
        policy: ``substitute`` (rerun each token's own top-k inside the budget set) or ``truncate`` (drop the
            out-of-budget slots and rescale the kept weights to the original total).
        window: window length W in positions; None = every row's tokens of this forward form one window
            (the verification block).
        offset: windows are ``[offset + jW, offset + (j+1)W)`` in absolute positions (positions before the
            offset form a first, shorter window).
        scope: ``sequence`` (each row has its own windows) or ``batch`` (all rows of the forward share them).
        start_position: positions before this are not budgeted (the prompt's prefill stays natural).
    """

    B: Any
    policy: str = "substitute"
    window: int | None = None
    offset: int = 0
    scope: str = "sequence"
    start_position: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise VatError(f"unknown budget policy `{self.policy}`: one of {', '.join(POLICIES)}")
        if self.scope not in SCOPES:
            raise VatError(f"unknown budget scope `{self.scope}`: one of {', '.join(SCOPES)}")
        if self.window is not None and self.window < 1:
            raise VatError(f"budget window must be >= 1, got {self.window}")

    def budget_for(self, layer_idx: int, moe_ordinal: int) -> int | None:
        """B for one MoE layer (None = that layer is not budgeted)."""
        if isinstance(self.B, Mapping):
            value = self.B.get(layer_idx, self.B.get(str(layer_idx)))
        elif isinstance(self.B, Sequence) and not isinstance(self.B, str):
            if moe_ordinal >= len(self.B):
                raise VatError(f"budget list has {len(self.B)} entries but the target has more MoE layers")
            value = self.B[moe_ordinal]
        else:
            value = self.B
        if value is None:
            return None
        value = int(value)
        if value < 1:
            raise VatError(f"expert budget must be >= 1, got {value} for layer {layer_idx}")
        return value


def window_groups(
    positions: torch.Tensor, valid: torch.Tensor, spec: BudgetSpec
) -> tuple[torch.Tensor, int]:
    """Budget-window id of every token.

    Args:
        positions: (B, T) absolute positions of the tokens of this forward.
        valid: (B, T) bool, False for padding (padding is never budgeted nor counted).
        spec: the budget spec (window, offset, scope, start_position).

    Returns:
        ``(groups (B, T) int64, n_groups)``; -1 = not budgeted.
    """
    batch, _ = positions.shape
    budgeted = valid & (positions >= spec.start_position)  # (B, T)
    if spec.window is None:
        local = torch.zeros_like(positions)
        n_local = 1
    else:
        local = torch.div(positions - spec.offset, spec.window, rounding_mode="floor")  # (B, T), may be -1
        lo = int(local[budgeted].min()) if budgeted.any() else 0
        local = local - lo
        n_local = int(local[budgeted].max()) + 1 if budgeted.any() else 1
    if spec.scope == "sequence":
        rows = torch.arange(batch, device=positions.device)[:, None]  # (B, 1)
        groups = rows * n_local + local
        n_groups = batch * n_local
    else:
        groups, n_groups = local, n_local
    groups = torch.where(budgeted, groups, torch.full_like(groups, -1))
    return groups, n_groups


def budget_sets(
    scores: torch.Tensor, natural_ids: torch.Tensor, groups: torch.Tensor, n_groups: int, budget: int
) -> torch.Tensor:
    """The expert set S of every window: its natural union if that fits in ``budget``, else top-B by score.

    Args:
        scores: (N, E) fp32 routing scores (softmax probabilities or the model's sigmoid scores).
        natural_ids: (N, k) the tokens' natural top-k ids.
        groups: (N,) window id per token, -1 = not budgeted.
        n_groups: number of windows.
        budget: B.

    Returns:
        (n_groups, E) bool: the allowed experts of each window.
    """
    num_experts = scores.shape[-1]
    member = groups >= 0  # (N,)
    g = groups.clamp_min(0)
    mass = torch.zeros(n_groups, num_experts, dtype=torch.float32, device=scores.device)
    mass.index_add_(0, g, scores.float() * member[:, None])  # (G, E): summed routing score per window
    used = torch.zeros(n_groups, num_experts + 1, dtype=torch.float32, device=scores.device)
    hits = torch.ones_like(natural_ids, dtype=torch.float32) * member[:, None]  # (N, k)
    used.index_put_((g[:, None].expand_as(natural_ids), natural_ids), hits, accumulate=True)
    union = used[:, :num_experts] > 0  # (G, E)
    fits = union.sum(-1) <= budget  # (G,)
    top = torch.zeros_like(union)
    top.scatter_(1, torch.topk(mass, min(budget, num_experts), dim=-1).indices, True)  # (G, E)
    return torch.where(fits[:, None], union, top)


def apply_budget(
    adapter: FamilyAdapter,
    router: torch.nn.Module,
    logits: torch.Tensor,
    natural: tuple[torch.Tensor, torch.Tensor],
    groups: torch.Tensor,
    n_groups: int,
    budget: int,
    policy: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Budget one MoE layer's routing.

    Args:
        adapter: the family's routing rule.
        router: the router module.
        logits: (N, E) router logits.
        natural: the router's own ``(topk_weights (N, k), topk_ids (N, k))``.
        groups: (N,) window id per token, -1 = leave natural.
        n_groups: number of windows.
        budget: B for this layer.
        policy: ``substitute`` or ``truncate``.

    Returns:
        ``(topk_weights (N, k), topk_ids (N, k))`` with at most B distinct ids per window; dropped slots hold
        the sentinel ``num_experts`` with weight 0. Tokens whose natural top-k lies inside S keep their natural
        weights and ids bit for bit.
    """
    weights, ids = natural
    num_experts = logits.shape[-1]
    if budget >= num_experts:
        return weights, ids
    allowed_sets = budget_sets(adapter.scores(router, logits), ids, groups, n_groups, budget)  # (G, E)
    member = groups >= 0
    allowed = allowed_sets[groups.clamp_min(0)] | ~member[:, None]  # (N, E); unbudgeted tokens allow all
    in_set = torch.cat([allowed, torch.zeros_like(allowed[:, :1])], dim=1).gather(1, ids)  # (N, k)
    inside = in_set.all(dim=1)  # (N,) natural top-k already inside S
    if bool(inside.all()):
        return weights, ids
    if policy == "substitute":
        new_w, new_ids = adapter.select(router, logits, allowed)
        new_w = new_w.to(weights.dtype)
    else:
        kept = weights * in_set  # (N, k)
        total = weights.sum(dim=1, keepdim=True)
        kept_total = kept.sum(dim=1, keepdim=True)
        scale = torch.where(kept_total > 0, total / kept_total.clamp_min(torch.finfo(kept.dtype).tiny), 0.0)
        new_w = (kept * scale).to(weights.dtype)
        new_ids = torch.where(in_set, ids, torch.full_like(ids, num_experts))
    keep_natural = inside[:, None]
    return torch.where(keep_natural, weights, new_w), torch.where(keep_natural, ids, new_ids)
