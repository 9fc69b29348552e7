"""Expert budgeting (MoE-Spec, DESIGN §3): per window, keep only B experts per MoE layer.

Pure tensor functions, applied by the router hook in :mod:`vat.target.routing`:

1. :func:`window_groups` assigns every token of a forward to a budget window (a group id), or -1 (unbudgeted);
2. :func:`budget_sets` picks each window's expert set S per layer: the window's natural union when it fits in B
   (so B >= union leaves the model bit-identical), else the top-B experts by summed routing score;
3. :func:`apply_budget` reroutes (``substitute``) or drops (``truncate``) the out-of-budget slots, keeping each
   family's own weighting rule through its :class:`~vat.target.families.FamilyAdapter`.

Coverage: a token none of whose natural top-k experts is in S ("uncovered") would get no expert output at all under
plain truncation; ``truncate`` reroutes such a token by substitution instead (MoE-Spec's coverage intent: every token
is served by the budget set), and both policies count these tokens (``TargetOutput.n_uncovered``).
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
    counts: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Budget one MoE layer's routing.

    ``substitute``: a token with an expert outside S reruns the model's own selection over S (k slots filled
    whenever S holds k experts). ``truncate``: its out-of-set slots are dropped and the kept weights rescaled to the
    natural total; a token with *no* natural expert in S (it would get zero expert output) is substituted instead.

    Args:
        adapter: the family's routing rule.
        router: the router module.
        logits: (N, E) router logits.
        natural: the router's own ``(topk_weights (N, k), topk_ids (N, k))``.
        groups: (N,) window id per token, -1 = leave natural.
        n_groups: number of windows.
        budget: B for this layer.
        policy: ``substitute`` or ``truncate``.
        counts: if given, receives ``"uncovered"``: a 0-d int64 tensor, the budgeted tokens none of whose natural
            experts is in S (no host sync: it stays on the device).

    Returns:
        ``(topk_weights (N, k), topk_ids (N, k))`` with at most B distinct ids per window; dropped slots hold
        the sentinel ``num_experts`` with weight 0. Tokens whose natural top-k lies inside S keep their natural
        weights and ids bit for bit.
    """
    weights, ids = natural
    num_experts = logits.shape[-1]
    if budget >= num_experts:
        if counts is not None:
            counts["uncovered"] = torch.zeros((), dtype=torch.int64, device=ids.device)
        return weights, ids
    allowed_sets = budget_sets(adapter.scores(router, logits), ids, groups, n_groups, budget)  # (G, E)
    member = groups >= 0
    allowed = allowed_sets[groups.clamp_min(0)] | ~member[:, None]  # (N, E); unbudgeted tokens allow all
    in_set = torch.cat([allowed, torch.zeros_like(allowed[:, :1])], dim=1).gather(1, ids)  # (N, k)
    inside = in_set.all(dim=1)  # (N,) natural top-k already inside S
    uncovered = ~in_set.any(dim=1)  # (N,) no natural expert in S (never true for unbudgeted tokens)
    if counts is not None:
        counts["uncovered"] = uncovered.sum()
    if bool(inside.all()):
        return weights, ids
    sub_w, sub_ids = adapter.select(router, logits, allowed)
    sub_w = sub_w.to(weights.dtype)
    if policy == "substitute":
        new_w, new_ids = sub_w, sub_ids
    else:
        new_w, new_ids = _truncate(weights, ids, in_set, num_experts)
        new_w = torch.where(uncovered[:, None], sub_w, new_w)  # coverage: nothing left to truncate to
        new_ids = torch.where(uncovered[:, None], sub_ids, new_ids)
    keep_natural = inside[:, None]
    return torch.where(keep_natural, weights, new_w), torch.where(keep_natural, ids, new_ids)


def _truncate(
    weights: torch.Tensor, ids: torch.Tensor, in_set: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the out-of-set slots (sentinel id, weight 0) and rescale the kept weights to the natural total.

    Args:
        weights: (N, k) natural weights.
        ids: (N, k) natural ids.
        in_set: (N, k) bool, slot's expert is in S.
        num_experts: E (the sentinel).

    Returns:
        ``(topk_weights (N, k), topk_ids (N, k))``; a row with no kept slot is all sentinel, weight 0.
    """
    kept = weights * in_set  # (N, k)
    total = weights.sum(dim=1, keepdim=True)
    kept_total = kept.sum(dim=1, keepdim=True)
    scale = torch.where(kept_total > 0, total / kept_total.clamp_min(torch.finfo(kept.dtype).tiny), 0.0)
    new_ids = torch.where(in_set, ids, torch.full_like(ids, num_experts))
    return (kept * scale).to(weights.dtype), new_ids
