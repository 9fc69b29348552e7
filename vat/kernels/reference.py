"""Torch reference for :func:`vat.kernels.fused_moe.fused_experts`: an obvious per-expert loop in fp32.

Numerics: every operand is upcast to fp32, the intermediate activation stays fp32, routing weights multiply the fp32
expert output, the k slots are summed in fp32, and the result is cast to ``hidden_states.dtype`` once at the end.
Slots whose id is the sentinel ``num_experts`` are skipped; a token with every slot dropped gets a zero output.
"""

from __future__ import annotations

import torch

from .layout import STANDARD, ExpertsLayout, gated_activation, split_gate_up


def fused_experts_reference(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    layout: ExpertsLayout = STANDARD,
) -> torch.Tensor:
    """Mixture-of-experts forward, one expert at a time, in fp32.

    Args:
        hidden_states: ``(T, H)`` token activations.
        gate_up_proj: ``(E, 2I, H)`` (``(E, H, 2I)`` if ``layout.is_transposed``).
        down_proj: ``(E, H, I)`` (``(E, I, H)`` if ``layout.is_transposed``).
        topk_ids: ``(T, k)`` expert ids in ``[0, E]``; ``E`` marks a dropped slot.
        topk_weights: ``(T, k)`` routing weights.
        gate_up_bias: optional ``(E, 2I)``.
        down_bias: optional ``(E, H)``.
        layout: weight layout and activation.

    Returns:
        ``(T, H)`` in ``hidden_states.dtype``.
    """
    num_experts = gate_up_proj.shape[0]
    x = hidden_states.float()  # (T, H)
    out = torch.zeros_like(x)  # (T, H) fp32
    for expert in range(num_experts):
        tok, slot = torch.where(topk_ids == expert)  # (n,), (n,)
        if tok.numel() == 0:
            continue
        w1 = gate_up_proj[expert].float()  # (2I, H) or (H, 2I)
        w2 = down_proj[expert].float()  # (H, I) or (I, H)
        if layout.is_transposed:
            w1, w2 = w1.t(), w2.t()
        h = x[tok] @ w1.t()  # (n, 2I)
        if gate_up_bias is not None:
            h = h + gate_up_bias[expert].float()
        act = gated_activation(*split_gate_up(h, layout), layout)  # (n, I)
        y = act @ w2.t()  # (n, H)
        if down_bias is not None:
            y = y + down_bias[expert].float()
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return out.to(hidden_states.dtype)
