"""Attention over one shared key set plus a few keys private to each group of queries (the drafters' training paths).

Both training forwards have queries that see (a) a masked part of one shared key set and (b) a handful of keys no
other query group sees:

* EAGLE-3's training-time test: the step-k query at anchor t sees the step-0 keys s <= t (shared) and its own chain
  (t, 1), ..., (t, k) (private: k keys per query).
* DFlash: slot s of block n sees the context keys before anchor n (shared) and the keys of block n (private to the
  block's ``block_size`` queries).

Written as one SDPA call over the concatenated keys (:func:`vat.drafters.common.masked_attention`, the reference),
part (b) is a dense mask over every query's private keys: a K-step unroll scores (K + 1) K / 2 · T^2 keys where
K · T^2 + (K - 1) K / 2 · T are needed (28 T^2 against 7 T^2 at K = 7), and DFlash scores every block's keys from
every block (N times the block keys). :func:`attention_with_private_keys` runs the shared part as one SDPA call over
the shared keys alone (SDPA's fused kernels) and the private part group by group, then normalises both under one
softmax: the same attention, exactly. It is the default on CPU; on CUDA the drafters keep the dense call until a GPU
has compared the two (``scripts/gpu_check.sh``). ``flex`` is the GPU path that skips the unneeded keys without
materialising scores: torch's ``flex_attention`` over the concatenated keys with a block mask built from the same
rule (:func:`flex_ttt_attention`, :func:`flex_block_attention`), compiled on CUDA. Its forward is checked against
the dense call on CPU (torch's eager flex has no CPU backward); its gradients are checked on a GPU
(``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vat.config import TRAINING_ATTENTION
from vat.drafters.common import repeat_kv


def resolve_attention_impl(impl: str, device: torch.device) -> str:
    """``auto`` -> ``blockwise`` on CPU, ``dense`` on other devices; other names (``TRAINING_ATTENTION``) returned."""
    if impl not in TRAINING_ATTENTION:
        raise ValueError(f"attention implementation {impl!r}: expected one of {', '.join(TRAINING_ATTENTION)}")
    if impl == "auto":
        return "blockwise" if device.type == "cpu" else "dense"
    return impl


_COMPILED: dict[str, object] = {}


def _flex(device: torch.device):
    """torch's ``flex_attention`` and ``create_block_mask``: compiled on CUDA (the fast path), eager elsewhere."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # optional: torch >= 2.5

    if device.type != "cuda":
        return flex_attention, create_block_mask, False
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention)
    return _COMPILED["flex"], create_block_mask, True


def flex_ttt_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attention_mask: torch.Tensor, window: int | None
) -> torch.Tensor:
    """EAGLE-3's step-k attention with flex_attention: query t sees step-0 key s iff s <= t, (s real or s = t) and
    (no window or t - s < window), and chain key (t, j) for 1 <= j <= k (the same rule as the dense mask).

    Args:
        q: (B, H, T, D) step-k queries.
        keys: (B, H_kv, (k+1) T, D) the step-0 keys then each chain step's, concatenated; values likewise.
        attention_mask: (B, T) bool, True = real token.
        window: ``sliding_window`` over the step-0 keys, or None.

    Returns:
        (B, H, T, D).
    """
    flex_attention, create_block_mask, compiled = _flex(q.device)
    B, _, T, _ = q.shape
    real = attention_mask.bool()
    limit = T if window is None else window

    def mask_mod(b, h, qi, ki):
        s = ki % T
        step0 = (s <= qi) & (real[b, s] | (s == qi)) & (qi - s < limit)
        return torch.where(ki < T, step0, s == qi)

    mask = create_block_mask(mask_mod, B, None, T, keys.shape[2], device=q.device, _compile=compiled)
    return flex_attention(q, keys, values, block_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])


def flex_block_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sees_until: torch.Tensor, attention_mask: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """DFlash's training attention with flex_attention: the query at slot s of block n sees context key j iff
    j < ``sees_until[b, n]`` and j is real, and every key of its own block (the same rule as the dense mask).

    Args:
        q: (B, H, Q, D) block queries, Q = N * block_size.
        keys: (B, H_kv, T + Q, D) [context ; blocks]; values likewise.
        sees_until: (B, N) int64, the context keys block n sees are those before it (0 for a padding block).
        attention_mask: (B, T) bool, True = real token.
        block_size: queries per block.

    Returns:
        (B, H, Q, D).
    """
    flex_attention, create_block_mask, compiled = _flex(q.device)
    B, _, Q, _ = q.shape
    T = attention_mask.shape[1]
    real = attention_mask.bool()

    def mask_mod(b, h, qi, ki):
        n = qi // block_size
        context = (ki < sees_until[b, n]) & real[b, ki.clamp(max=T - 1)]
        return torch.where(ki < T, context, (ki - T) // block_size == n)

    mask = create_block_mask(mask_mod, B, None, Q, keys.shape[2], device=q.device, _compile=compiled)
    return flex_attention(q, keys, values, block_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])


def attention_with_private_keys(
    q: torch.Tensor,
    k_shared: torch.Tensor,
    v_shared: torch.Tensor,
    shared_mask: torch.Tensor,
    k_private: torch.Tensor,
    v_private: torch.Tensor,
    private_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of each query over [its allowed shared keys ; its group's private keys].

    Queries come in N groups of R consecutive queries (Q = N · R); group n additionally sees its own P private keys.
    EAGLE-3's unroll has R = 1 (one anchor per group, P = its chain so far), DFlash R = P = block_size.

    The shared part runs as one SDPA call (its fused kernels), the private part as explicit dot products, and the two
    are normalised together from the shared part's log-sum-exp, which SDPA does not return: one extra shared key
    (a zero key with additive bias c_q, value the unit vector of an extra value channel) reads it out. That channel
    carries x = e^c / (Z_s + e^c), so log Z_s = c + log(1 - x) - log x; c_q is any constant (the output does not depend
    on it), chosen per head as the private part's log-sum-exp: x = Z_p / (Z_s + Z_p) is then exact where it matters (the
    log of a small x is precise; a large x means the shared part is negligible anyway). Gradients flow through SDPA's
    own backward. The bias is a (B, H, Q, S + 1) tensor: this path is for CPU-sized batches.

    Args:
        q: (B, H, Q, D) queries (already rotated).
        k_shared: (B, H_kv, S, D) shared keys (already rotated); H must be a multiple of H_kv (grouped-query heads:
            query head h reads key head h // (H / H_kv), as ``repeat_interleave`` expands them).
        v_shared: (B, H_kv, S, Dv).
        shared_mask: (B, 1, Q, S) bool, True where the query may attend the shared key (broadcastable over B); a
            query may see no shared key at all.
        k_private: (B, H_kv, N, P, D) each group's private keys.
        v_private: (B, H_kv, N, P, Dv).
        private_mask: (B, 1, Q, P) bool or None (every private key allowed). Every query must allow at least one key.

    Returns:
        (B, H, Q, Dv) attention output in ``q``'s dtype.
    """
    B, H, Q, D = q.shape
    Hkv, S, Dv = k_shared.shape[1], k_shared.shape[2], v_shared.shape[3]
    N, P = k_private.shape[2], k_private.shape[3]
    G, R = H // Hkv, Q // N
    tiny = torch.finfo(torch.float32).tiny
    private = torch.matmul((q * D**-0.5).view(B, Hkv, G, N, R, D), k_private.unsqueeze(2).transpose(-1, -2))
    private = private.view(B, H, Q, P).float()  # (B, H, Q, P) scaled scores
    if private_mask is not None:
        private = private.masked_fill(~private_mask, float("-inf"))
    lse_private = torch.logsumexp(private, dim=-1)  # (B, H, Q), -inf where no private key is allowed
    c = lse_private.detach()  # (B, H, Q) the read-out key's bias, per head
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c)).to(q.dtype).float()  # as SDPA will read it
    bias = torch.zeros(B, H, Q, S + 1, dtype=q.dtype, device=q.device)
    bias[..., :S].masked_fill_(~shared_mask.expand(B, H, Q, S), float("-inf"))
    bias[..., S] = c.to(q.dtype)
    keys = torch.cat([k_shared, k_shared.new_zeros(B, Hkv, 1, D)], dim=2)  # (B, Hkv, S + 1, D)
    width = Dv + 8 - Dv % 8  # one read-out channel, padded to a multiple of 8 (what fused kernels take)
    readout = v_shared.new_zeros(B, Hkv, 1, width)
    readout[..., Dv] = 1.0
    values = torch.cat([F.pad(v_shared, (0, width - Dv)), readout], dim=2)  # (B, Hkv, S + 1, width)
    out = F.scaled_dot_product_attention(q, repeat_kv(keys, G), repeat_kv(values, G), attn_mask=bias)
    x = out[..., Dv].float()  # (B, H, Q) = e^c / (Z_s + e^c)
    log_x = x.clamp(min=tiny).log()
    lse_shared = c + (1 - x).clamp(min=tiny).log() - log_x  # (B, H, Q) log Z_s
    lse = torch.logaddexp(lse_shared, lse_private)  # (B, H, Q) log (Z_s + Z_p)
    shared_part = out[..., :Dv] * (c - log_x - lse).exp().unsqueeze(-1).to(out.dtype)  # Σ_s e^{s} v_s / Z
    w_private = (private - lse.unsqueeze(-1)).exp().to(v_private.dtype)  # (B, H, Q, P)
    private_part = torch.matmul(w_private.view(B, Hkv, G, N, R, P), v_private.unsqueeze(2)).view(B, H, Q, Dv)
    return shared_part + private_part
