"""Building blocks shared by the drafters: RMSNorm, rotary embeddings, SwiGLU MLP, masked SDPA attention.

These are deliberately small, self-contained re-implementations of the Llama pieces (no transformers internals), so
the draft's numerics are fixed by this file and match what SGLang / vLLM run at serving time:

* RMSNorm normalises in fp32 and multiplies the weight after casting back (Llama / SGLang order).
* RoPE is the "rotate-half" (NeoX / HF Llama) layout with the default (unscaled) frequency schedule.
* Attention is :func:`torch.nn.functional.scaled_dot_product_attention` with a boolean mask (True = may attend);
  grouped-query heads are expanded with ``repeat_interleave`` so every SDPA backend accepts the call.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vat.errors import VatError


class DraftInputs:
    """What every drafter does with the target's frozen input embedding and with RoPE, mixed into its ``nn.Module``.

    The drafter sets ``_embedding`` (a frozen embedding module or None) with ``object.__setattr__`` so it is neither
    a parameter nor saved, and has ``config`` (``head_dim``, ``rope_theta``) and ``fc`` (whose weight fixes the
    draft's dtype and device).
    """

    @property
    def embed_tokens(self) -> nn.Module | None:
        """The frozen target embedding, or None before ``set_embedding``."""
        return self._embedding

    @property
    def _dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) ids -> (B, T, H) target embeddings in the draft's dtype and device."""
        if self.embed_tokens is None:
            raise VatError("the draft has no embedding: call set_embedding(target input embeddings) first")
        return self.embed_tokens(input_ids).to(device=self.fc.weight.device, dtype=self._dtype)

    def _rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, self._dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``weight * x / sqrt(mean(x^2) + eps)``, statistics in fp32.

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: added to the mean square for stability.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SwiGLUMLP(nn.Module):
    """Llama MLP: ``down(silu(gate(x)) * up(x))``, no biases (names match SGLang / HF: gate_proj, up_proj, down_proj)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables of the default RoPE schedule at the given positions.

    Args:
        position_ids: (B, T) integer positions.
        head_dim: rotary dimension (the full head dim, as in Llama).
        theta: RoPE base (``rope_theta``).
        dtype: dtype of the returned tables (angles are always computed in fp32).

    Returns:
        ``(cos, sin)``, each (B, T, head_dim).
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    )
    angles = position_ids.float().unsqueeze(-1) * inv_freq  # (B, T, head_dim / 2)
    emb = torch.cat([angles, angles], dim=-1)  # (B, T, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, heads, T, head_dim) by the tables ``cos``/``sin`` (B, T, head_dim)."""
    cos = cos.unsqueeze(1)  # (B, 1, T, head_dim)
    sin = sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Expand (B, H_kv, S, D) key/value heads to (B, H_kv * num_groups, S, D) for grouped-query attention."""
    return x if num_groups == 1 else x.repeat_interleave(num_groups, dim=1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention with an explicit boolean mask.

    Args:
        q: (B, H, T, D) queries (already rotated).
        k: (B, H_kv, S, D) keys (already rotated); H must be a multiple of H_kv.
        v: (B, H_kv, S, D) values.
        mask: (B, 1, T, S) or broadcastable, True where the query may attend the key. Every query row must allow at
            least one key (callers always allow the query's own entry), otherwise SDPA returns NaN.

    Returns:
        (B, H, T, D) attention output.
    """
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask)


def check_config_keys(cls: type, data: dict[str, Any]) -> None:
    """One :class:`VatError` line for a key of ``data`` that is not a field of the dataclass ``cls``."""
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise VatError(f"unknown {cls.__name__} key {key!r}{hint}")


def draft_dims_for_target(target_config: Any) -> dict[str, Any]:
    """The draft-layer fields every drafter sizes from a transformers target config (dims, heads, RoPE, vocab).

    The draft MLP is dense: the target's ``intermediate_size`` when it is a dense width (>= 2 * hidden, as in
    Qwen-MoE / DeepSeek configs), otherwise (per-expert widths such as OLMoE's) ``4 * hidden_size``.
    """
    tc = getattr(target_config, "text_config", None) or target_config
    hidden = tc.hidden_size
    inter = getattr(tc, "intermediate_size", None) or 4 * hidden
    if inter < 2 * hidden:
        inter = 4 * hidden
    rope = getattr(tc, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta or getattr(tc, "rope_theta", None) or 10000.0
    heads = tc.num_attention_heads
    return dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or hidden // heads,
        target_hidden_size=hidden,
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 4096)),
        vocab_size=tc.vocab_size,
        num_target_layers=tc.num_hidden_layers,
        target_path=getattr(tc, "_name_or_path", None) or None,
    )
