"""How an experts module stores its weights and which gated activation it applies.

transformers 5.x experts modules keep all experts in two 3-D parameters. Two layouts exist among the supported families:

- standard (OLMoE, Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3): ``gate_up_proj (E, 2I, H)`` with gate = rows ``[0, I)``
  and up = rows ``[I, 2I)`` ("concatenated"), ``down_proj (E, H, I)``, no bias, ``silu(gate) * up``.
- GPT-OSS: ``gate_up_proj (E, H, 2I)`` ("transposed") with gate = columns ``0::2`` and up = ``1::2`` ("interleaved"),
  ``down_proj (E, I, H)``, biases ``(E, 2I)`` / ``(E, H)``, and a clamped GLU:
  ``g = min(gate, limit); u = clamp(up, -limit, limit); (u + 1) * g * sigmoid(alpha * g)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gpt_oss_glu")


@dataclass(frozen=True)
class ExpertsLayout:
    """Weight layout and gated activation of an experts module.

    Attributes:
        is_transposed: weights stored ``(E, in, out)`` instead of ``(E, out, in)``.
        is_concatenated: gate/up stored as two halves; otherwise interleaved (gate at even, up at odd positions).
        activation: ``"silu"`` (``silu(gate) * up``) or ``"gpt_oss_glu"`` (clamped GLU, see the module docstring).
        alpha: GLU slope for ``gpt_oss_glu``.
        limit: GLU clamp for ``gpt_oss_glu``.
    """

    is_transposed: bool = False
    is_concatenated: bool = True
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")


STANDARD = ExpertsLayout()


def split_gate_up(gate_up: torch.Tensor, layout: ExpertsLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a ``(..., 2I)`` projection output into ``gate, up`` (each ``(..., I)``) according to ``layout``."""
    if layout.is_concatenated:
        return gate_up.chunk(2, dim=-1)
    return gate_up[..., 0::2], gate_up[..., 1::2]


def gated_activation(gate: torch.Tensor, up: torch.Tensor, layout: ExpertsLayout) -> torch.Tensor:
    """The torch form of the kernel's activation epilogue: ``(..., I), (..., I) -> (..., I)``."""
    if layout.activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=layout.limit)
    up = up.clamp(min=-layout.limit, max=layout.limit)
    return (up + 1) * gate * torch.sigmoid(gate * layout.alpha)
