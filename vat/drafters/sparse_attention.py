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
every block (N times the block keys). :func:`attention_with_private_keys` scores the shared part with one masked
matmul and the private part group by group, then normalises both under one softmax: the same attention, exactly.

It materialises the (Q, S) shared scores, as SDPA's math path does; on CUDA, where SDPA's fused kernels do not, the
drafters keep the dense call unless asked otherwise. ``flex`` is the GPU path that skips the unneeded keys without
materialising scores: torch's ``flex_attention`` over the concatenated keys with a block mask built from the same
rule (:func:`flex_ttt_attention`, :func:`flex_block_attention`), compiled on CUDA. Its forward is checked against
the dense call on CPU (torch's eager flex has no CPU backward); its gradients are checked on a GPU
(``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import torch

from vat.config import TRAINING_ATTENTION


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

    Args:
        q: (B, H, Q, D) queries (already rotated).
        k_shared: (B, H_kv, S, D) shared keys (already rotated); H must be a multiple of H_kv (grouped-query heads:
            query head h reads key head h // (H / H_kv), as ``repeat_interleave`` expands them).
        v_shared: (B, H_kv, S, D).
        shared_mask: (B, 1, Q, S) bool, True where the query may attend the shared key (broadcastable over B).
        k_private: (B, H_kv, N, P, D) each group's private keys.
        v_private: (B, H_kv, N, P, D).
        private_mask: (B, 1, Q, P) bool or None (every private key allowed). Every query must allow at least one key.

    Returns:
        (B, H, Q, D) attention output in ``q``'s dtype (scores normalised in fp32).
    """
    B, H, Q, D = q.shape
    Hkv, S = k_shared.shape[1], k_shared.shape[2]
    N, P = k_private.shape[2], k_private.shape[3]
    G, R = H // Hkv, Q // N
    qg = (q * D**-0.5).view(B, Hkv, G, Q, D)
    shared = torch.matmul(qg, k_shared.unsqueeze(2).transpose(-1, -2))  # (B, Hkv, G, Q, S)
    private = torch.matmul(qg.view(B, Hkv, G, N, R, D), k_private.unsqueeze(2).transpose(-1, -2))
    scores = torch.cat([shared, private.view(B, Hkv, G, Q, P)], dim=-1).float()  # (B, Hkv, G, Q, S + P)
    allowed = shared_mask.unsqueeze(2).expand(B, 1, 1, Q, S)
    if private_mask is None:
        allowed = torch.cat([allowed, allowed.new_ones(B, 1, 1, Q, P)], dim=-1)
    else:
        allowed = torch.cat([allowed, private_mask.unsqueeze(2).expand(B, 1, 1, Q, P)], dim=-1)  # (B, 1, 1, Q, S + P)
    weights = torch.softmax(scores.masked_fill_(~allowed, float("-inf")), dim=-1).to(q.dtype)
    out = torch.matmul(weights[..., :S], v_shared.unsqueeze(2))  # (B, Hkv, G, Q, D)
    w_private = weights[..., S:].reshape(B, Hkv, G, N, R, P)
    out = out + torch.matmul(w_private, v_private.unsqueeze(2)).view(B, Hkv, G, Q, D)
    return out.view(B, H, Q, D)
