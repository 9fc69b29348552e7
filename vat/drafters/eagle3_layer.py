"""The EAGLE-3 draft's decoder layer (``midlayer``), its attention and the frozen shared embedding.

Split from :mod:`vat.drafters.eagle3` (which re-exports these names); the drafter composes them into the TTT and
KV-cache paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vat.drafters.common import RMSNorm, SwiGLUMLP, apply_rope
from vat.drafters.eagle3_config import Eagle3Config


class FrozenEmbedding(nn.Module):
    """The target's token embedding, frozen and shared (the tensor is not copied).

    :class:`Eagle3Drafter` holds it *unregistered*: it is not a parameter, not a buffer and never in ``state_dict()``
    (so never saved), and ``.to()`` / DDP / FSDP on the draft leave it alone: it stays on the target's device and dtype,
    and looked-up rows are moved to the draft's device and dtype.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.detach(), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids.to(self.weight.device), self.weight)


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v projections read the 2H-wide ``cat(embed, hidden)`` input."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, 2H) -> rotated q (B, nh, T, hd), rotated k (B, nkv, T, hd), v (B, nkv, T, hd)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class Eagle3DecoderLayer(nn.Module):
    """The single EAGLE-3 decoder layer (``midlayer``), split in two halves around attention so the TTT and
    KV-cache paths share every projection and norm."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, H) embeddings and hidden -> attention input (B, T, 2H) and the residual (B, T, H)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def output(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output (B, nh, T, hd) + residual (B, T, H) -> pre-norm hidden (B, T, H)."""
        B, _, T, _ = attn.shape
        h = residual + self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        return h + self.mlp(self.post_attention_layernorm(h))
