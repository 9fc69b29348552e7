"""Expert-traffic accounting: the union of experts a window loads per MoE layer, and what it weighs in bytes.

Bytes per round = Σ_l U_l · b_l, with b_l one expert's weight bytes in layer l (docs/verification_policies.md).
"""

from __future__ import annotations

import torch

from vat.target.budget import BudgetSpec, window_groups


def window_union(topk_ids: torch.Tensor, groups: torch.Tensor, n_groups: int, num_experts: int) -> torch.Tensor:
    """Number of distinct experts each window executes in each MoE layer.

    Args:
        topk_ids: (L', B, T, k) executed expert ids; ``num_experts`` (a dropped slot) is not counted.
        groups: (B, T) window id per token; -1 = not counted (padding, unbudgeted prefill).
        n_groups: number of windows.
        num_experts: E.

    Returns:
        (L', n_groups) int64 union sizes.
    """
    num_layers = topk_ids.shape[0]
    k = topk_ids.shape[-1]
    flat_ids = topk_ids.reshape(num_layers, -1, k)  # (L', N, k)
    g = groups.reshape(-1)  # (N,)
    member = g >= 0
    hit = torch.zeros(num_layers, n_groups, num_experts + 1, dtype=torch.bool, device=topk_ids.device)
    layer_idx = torch.arange(num_layers, device=topk_ids.device)[:, None, None].expand_as(flat_ids)
    group_idx = g.clamp_min(0)[None, :, None].expand_as(flat_ids)
    keep = member[None, :, None].expand_as(flat_ids)
    hit[layer_idx[keep], group_idx[keep], flat_ids[keep]] = True
    return hit[..., :num_experts].sum(-1)  # (L', G)


def contiguous_windows(valid: torch.Tensor, window: int, offset: int = 0) -> tuple[torch.Tensor, int]:
    """Window ids for windows of ``window`` consecutive positions per row (no budget involved).

    Args:
        valid: (B, T) bool of real tokens.
        window: W.
        offset: the first window starts at this position (earlier positions form a shorter window).

    Returns:
        ``(groups (B, T), n_groups)`` with -1 on padding.
    """
    batch, length = valid.shape
    positions = torch.arange(length, device=valid.device).expand(batch, -1)
    return window_groups(positions, valid, BudgetSpec(B=None, window=window, offset=offset))


def bytes_per_window(unions: torch.Tensor, expert_bytes_per_layer: list[int]) -> torch.Tensor:
    """Expert-weight bytes each window reads: Σ_l U_l · b_l.

    Args:
        unions: (L', G) union sizes.
        expert_bytes_per_layer: b_l for each of the L' MoE layers.

    Returns:
        (G,) float64 bytes.
    """
    b = torch.tensor(expert_bytes_per_layer, dtype=torch.float64, device=unions.device)  # (L',)
    return (unions.double() * b[:, None]).sum(0)
