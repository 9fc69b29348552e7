"""DFlash block drafter: Qwen3-style decoder layers that draft a whole block in one pass (docs/vat_losses.md).

Architecture (z-lab ``DFlashDraftModel``; weight names are its release layout)::

    ctx = hidden_norm(fc(cat(h_l for l in target_layer_ids)))   # (B, S, H)  target layer outputs at committed positions
    x   = embed([anchor, MASK, ..., MASK])                       # (B, block_size, H)  the target's frozen embedding
    per draft layer:
        h = input_layernorm(x)
        q = rope(q_norm(q_proj(h)))                              # queries from the block only
        k = rope(k_norm(k_proj([ctx ; h])))                      # context injected as extra keys / values,
        v = v_proj([ctx ; h])                                    # the same projections as the block's
        x = x + o_proj(attn(q, k, v))                            # bidirectional inside the block
        x = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(x))[1:]                                # the target's frozen LM head: block_size - 1 drafts

The draft has no embedding or LM head of its own: both are the target's, attached unregistered (never parameters,
never in ``state_dict()``, never saved, not moved by ``.to()``). Block position s sits at RoPE position
``anchor + s``; context entry j at position j; a block sees context strictly before its anchor.

Slot layout shared with :mod:`vat.verify` and :mod:`vat.losses`: slot k = 0..K-1 (K = block_size - 1) is block
position k + 1 and predicts token ``anchor + 1 + k``; its target distribution is the target's logits at
``anchor + k``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from vat.drafters.common import DraftInputs, RMSNorm, SwiGLUMLP, apply_rope, masked_attention, rope_cos_sin
from vat.drafters.dflash_config import DFlashConfig, check_dflash_matches_target, default_target_layer_ids
from vat.drafters.eagle3 import VH_PRIOR
from vat.drafters.eagle3_layer import FrozenEmbedding
from vat.drafters.sparse_attention import attention_with_private_keys, flex_block_attention, resolve_attention_impl
from vat.errors import VatError
from vat.imitation import HeadLogits


class FrozenLMHead(nn.Module):
    """The target's LM head, frozen and shared (held unregistered by the drafter, like :class:`FrozenEmbedding`).

    Hidden states are cast to the head's device and dtype; gradients flow to them, never to the weight.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.detach(), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.to(device=self.weight.device, dtype=self.weight.dtype), self.weight)


class DFlashAttention(nn.Module):
    """Qwen3 attention (per-head q/k RMSNorm, no biases) whose keys and values also cover the context features."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> rotated, normed queries (B, nh, T, hd)."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def keys_values(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, H) block states or context features -> rotated, normed keys and values (B, nkv, T, hd)."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v


class DFlashDecoderLayer(nn.Module):
    """One draft layer: pre-norm attention over [context ; block] and a SwiGLU MLP, both residual."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockAttention | None,
    ) -> torch.Tensor:
        """Block states (B, Q, H) attend to ``context_kv`` (B, nkv, S, hd) x2 and to the block itself.

        Args:
            mask: (B, 1, Q, S + Q) bool over [context ; block] keys, True = may attend; None = all; or a
                :class:`BlockAttention` (the training forward's blocks, blockwise or flex).
        """
        B, Q, _ = x.shape
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, cos, sin)  # (B, nh, Q, hd)
        k_block, v_block = self.self_attn.keys_values(h, cos, sin)  # (B, nkv, Q, hd)
        if isinstance(mask, BlockAttention):
            attn = mask.attend(q, context_kv, k_block, v_block)
        else:
            k = torch.cat([context_kv[0], k_block], dim=2)  # (B, nkv, S + Q, hd)
            v = torch.cat([context_kv[1], v_block], dim=2)
            attn = masked_attention(q, k, v, mask)  # (B, nh, Q, hd)
        x = x + self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, Q, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class BlockAttention:
    """The training forward's attention rule without a (Q, S + Q) mask: the query at slot s of block n sees context
    key j iff j < ``sees_until[b, n]`` and j is real, and every key of its own block, no other block's.

    Attributes:
        impl: ``blockwise`` (:func:`attention_with_private_keys`) or ``flex`` (:func:`flex_block_attention`).
        sees_until: (B, N) int64 context keys visible to block n (0 for a padding block).
        attention_mask: (B, T) bool, True = real token.
        block_size: queries per block.
    """

    impl: str
    sees_until: torch.Tensor
    attention_mask: torch.Tensor
    block_size: int

    def attend(self, q: torch.Tensor, context_kv: tuple[torch.Tensor, torch.Tensor], k_block: torch.Tensor,
               v_block: torch.Tensor) -> torch.Tensor:
        """(B, nh, Q, hd) queries over [context ; own block] -> (B, nh, Q, hd)."""
        if self.impl == "flex":
            keys = torch.cat([context_kv[0], k_block], dim=2)  # (B, nkv, T + Q, hd)
            values = torch.cat([context_kv[1], v_block], dim=2)
            return flex_block_attention(q, keys, values, self.sees_until, self.attention_mask, self.block_size)
        B, nkv, Q, hd = k_block.shape
        blocks = (B, nkv, Q // self.block_size, self.block_size, hd)
        return attention_with_private_keys(q, *context_kv, self.sees, k_block.view(blocks), v_block.view(blocks))

    @cached_property
    def sees(self) -> torch.Tensor:
        """(B, 1, Q, T) bool: the context keys each query sees (built once, read by every layer)."""
        context = torch.arange(self.attention_mask.shape[1], device=self.sees_until.device)  # (T,)
        sees = (context < self.sees_until[:, :, None]) & self.attention_mask[:, None, :]  # (B, N, T)
        return sees.repeat_interleave(self.block_size, dim=1)[:, None]


@dataclass
class DFlashBlockOutput:
    """Per-slot outputs of :meth:`DFlashDrafter.forward` / :meth:`DFlashDrafter.draft_block`.

    Index ``[b, n, k]`` = row b, block (anchor) n, slot k; slot k predicts token ``anchor + 1 + k``.

    Attributes:
        logits: (B, N, K, V) logits over the target vocabulary (the target's LM head), or their
            :class:`vat.imitation.HeadLogits` (training with ``head_logits``).
        hidden: (B, N, K, H) the slots' normed hidden states (what the LM head and the verification head read).
        vh_logits: (B, N, K) verification-head logits (apply sigmoid), or None without a head.
    """

    logits: torch.Tensor | HeadLogits
    hidden: torch.Tensor
    vh_logits: torch.Tensor | None = None


@dataclass
class DFlashCache:
    """The draft's context keys and values for inference: one entry per committed position, per layer.

    Block keys are never stored (each round's block is new), so nothing is cropped after drafting.

    Attributes:
        keys: per layer (B, nkv, S, hd) rotated context keys.
        values: per layer (B, nkv, S, hd) context values.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        """Committed context entries S (positions 0..S-1)."""
        return self.keys[0].shape[2]


class DFlashDrafter(DraftInputs, nn.Module):
    """The DFlash block drafter (see the module docstring for the graph and naming).

    Args:
        config: the draft config.
        embed_weight: (V, H) the target's input embedding (shared, frozen, never saved); may be set later.
        lm_head_weight: (V, H) the target's LM head (shared, frozen, never saved); may be set later.
    """

    def __init__(
        self, config: DFlashConfig, embed_weight: torch.Tensor | None = None, lm_head_weight: torch.Tensor | None = None
    ):
        super().__init__()
        if config.target_layer_ids is None:
            raise VatError("DFlashConfig.target_layer_ids is unset: give num_target_layers or the ids")
        self.config = cfg = config
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.verification_head = nn.Linear(cfg.hidden_size, 1) if cfg.verification_head else None
        if self.verification_head is not None:
            self.reset_verification_head()
        object.__setattr__(self, "_embedding", None)  # unregistered on purpose (see FrozenEmbedding)
        object.__setattr__(self, "_lm_head", None)
        if embed_weight is not None:
            self.set_embedding(embed_weight)
        if lm_head_weight is not None:
            self.set_lm_head(lm_head_weight)

    # -- set-up ---------------------------------------------------------------------------------------------------

    def set_embedding(self, weight: torch.Tensor) -> None:
        """Attach the target's (V, H) input embedding (frozen; shared storage; not saved)."""
        self._check_table(weight, "embedding")
        object.__setattr__(self, "_embedding", FrozenEmbedding(weight))

    def set_lm_head(self, weight: torch.Tensor) -> None:
        """Attach the target's (V, H) LM head weight (frozen; shared storage; not saved)."""
        self._check_table(weight, "LM head")
        object.__setattr__(self, "_lm_head", FrozenLMHead(weight))

    def _check_table(self, weight: torch.Tensor, what: str) -> None:
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise VatError(f"target {what} has shape {tuple(weight.shape)}, the draft expects {expected} (vocab, hidden)")

    @property
    def lm_head(self) -> FrozenLMHead | None:
        """The frozen target LM head, or None before :meth:`set_lm_head`."""
        return self._lm_head

    @torch.no_grad()
    def reset_verification_head(self) -> None:
        """Zero weight and bias logit(``VH_PRIOR``): the head predicts the prior and sends no gradient into the body."""
        self.verification_head.weight.zero_()
        self.verification_head.bias.fill_(math.log(VH_PRIOR / (1.0 - VH_PRIOR)))

    # -- shared pieces --------------------------------------------------------------------------------------------

    def project_context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """(B, S, n*H_t) concatenated target layer outputs -> context features (B, S, H): ``hidden_norm(fc(.))``."""
        return self.hidden_norm(self.fc(aux_hidden.to(self._dtype)))

    def context_kv(self, context: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context features (B, S, H) at ``position_ids`` (B, S) -> per layer rotated keys and values (B, nkv, S, hd)."""
        cos, sin = self._rope(position_ids)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def run_block(
        self,
        block_ids: torch.Tensor,
        position_ids: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | BlockAttention | None = None,
    ) -> torch.Tensor:
        """Block tokens (B, Q) at ``position_ids`` (B, Q) through every layer -> normed hidden states (B, Q, H).

        ``mask`` as in :meth:`DFlashDecoderLayer.forward`."""
        x = self._embed(block_ids)  # (B, Q, H)
        cos, sin = self._rope(position_ids)
        for layer, kv in zip(self.layers, context_kv):
            x = layer(x, kv, cos, sin, mask)
        return self.norm(x)

    def readout(self, normed: torch.Tensor, vh_detach: bool = False,
                head_logits: float | None = None) -> tuple[torch.Tensor | HeadLogits, torch.Tensor | None]:
        """Normed hidden (…, H) -> logits (…, V) through the target's LM head (or, with ``head_logits`` = MiB per
        chunk, the :class:`vat.imitation.HeadLogits` the loss runs a chunk at a time), and VH logits (…,) or None."""
        if self.lm_head is None:
            raise VatError("the draft has no LM head: call set_lm_head(target LM head weight) first")
        vh = None
        if self.verification_head is not None:
            vh = self.verification_head(normed.detach() if vh_detach else normed).squeeze(-1)
        if head_logits is not None:
            return HeadLogits(normed, self.lm_head.weight, float(head_logits)), vh
        return self.lm_head(normed), vh

    def block_input(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """Anchor tokens (…,) -> block inputs (…, block_size): ``[anchor, MASK, ..., MASK]``."""
        block = anchor_ids.new_full((*anchor_ids.shape, self.config.block_size), self.config.mask_token_id)
        block[..., 0] = anchor_ids
        return block

    # -- training: every sampled anchor of a batch in one forward -------------------------------------------------

    def forward(
        self,
        aux_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        vh_detach: bool = False,
        attention: str = "auto",
        head_logits: float | None = None,
    ) -> DFlashBlockOutput:
        """Draft one block per anchor, every block of the batch in one pass.

        Keys are [context (T entries, target features at positions 0..T-1) ; all blocks (N * block_size)]; the query
        at slot s of block n (RoPE position ``anchor_n + s``) may attend context entry j iff ``j < anchor_n`` and j is
        a real token, and the keys of its own block (bidirectional); never another block.

        Args:
            aux_hidden: (B, T, n*H_t) target layer outputs at every position (``target_layer_ids`` order).
            input_ids: (B, T) tokens (the anchor tokens are read from here).
            anchors: (B, N) int64 anchor positions, ``-1`` = padding (its block sees only itself; mask its slots).
            attention_mask: (B, T) 1 = real token; None = all real.
            vh_detach: the verification head reads detached hidden states (``loss.vh_detach``).
            attention: ``dense`` (SDPA over [context ; every block] with a (Q, T + Q) mask, the reference),
                ``blockwise`` (each block scores only its own keys beside the context:
                :mod:`vat.drafters.sparse_attention`), ``flex`` (flex_attention with a block mask of the same rule;
                CUDA) or ``auto`` (blockwise on CPU, dense elsewhere).
            head_logits: fp32 MiB per chunk: return the logits as :class:`vat.imitation.HeadLogits` (the slots'
                hidden states and the LM head, read a chunk at a time: training with ``loss.imitation_chunk_mb``);
                None = materialised logits.

        Returns:
            :class:`DFlashBlockOutput` with logits (B, N, K, V), hidden (B, N, K, H), vh_logits (B, N, K) or None.
        """
        B, T = input_ids.shape
        N, Bs = anchors.shape[1], self.config.block_size
        device = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.bool, device=device)
        real = anchors >= 0  # (B, N)
        start = anchors.clamp(min=0)  # (B, N)
        positions = torch.arange(T, device=device).expand(B, T)
        context_kv = self.context_kv(self.project_context(aux_hidden), positions)

        anchor_ids = input_ids.gather(1, start)  # (B, N)
        block_ids = self.block_input(anchor_ids).reshape(B, N * Bs)  # (B, Q)
        block_pos = (start[:, :, None] + torch.arange(Bs, device=device)).reshape(B, N * Bs)  # (B, Q)
        # context j visible to block n iff j < anchor_n (strictly: at inference the anchor's own features do not
        # exist yet) and j is real; a padding block (anchor -1) sees no context
        sees_until = torch.where(real, start, 0)  # (B, N)
        impl = resolve_attention_impl(attention, device)
        if impl in ("blockwise", "flex"):
            rule = BlockAttention(impl, sees_until, attention_mask.bool(), Bs)
            normed = self.run_block(block_ids, block_pos, context_kv, rule)  # (B, Q, H)
        else:
            sees = (torch.arange(T, device=device) < sees_until[:, :, None]) & attention_mask.bool()[:, None, :]
            sees = sees[:, :, None, :].expand(B, N, Bs, T).reshape(B, N * Bs, T)  # (B, Q, T)
            block_of = torch.arange(N * Bs, device=device) // Bs  # (Q,)
            own = (block_of[:, None] == block_of[None, :]).expand(B, N * Bs, N * Bs)  # (B, Q, Q)
            mask = torch.cat([sees, own], dim=-1)[:, None]  # (B, 1, Q, T + Q)
            normed = self.run_block(block_ids, block_pos, context_kv, mask)  # (B, Q, H)
        slots = normed.view(B, N, Bs, -1)[:, :, 1:]  # (B, N, K, H): position 0 is the anchor itself
        logits, vh = self.readout(slots, vh_detach, head_logits)
        return DFlashBlockOutput(logits=logits, hidden=slots, vh_logits=vh)

    # -- inference with a context cache ---------------------------------------------------------------------------

    def new_cache(self, batch_size: int = 1, device: torch.device | None = None) -> DFlashCache:
        """An empty :class:`DFlashCache` for ``batch_size`` rows."""
        device = device or self.fc.weight.device
        cfg = self.config
        empty = torch.zeros(batch_size, cfg.num_key_value_heads, 0, cfg.head_dim, dtype=self._dtype, device=device)
        return DFlashCache(keys=[empty] * cfg.num_hidden_layers, values=[empty] * cfg.num_hidden_layers)

    @torch.no_grad()
    def extend_context(self, cache: DFlashCache, aux_hidden: torch.Tensor) -> None:
        """Append the target features (B, n, n*H_t) of newly committed positions ``S .. S+n-1`` to the cache."""
        B, n, _ = aux_hidden.shape
        positions = cache.length + torch.arange(n, device=aux_hidden.device).expand(B, n)
        for i, (k, v) in enumerate(self.context_kv(self.project_context(aux_hidden), positions)):
            cache.keys[i] = torch.cat([cache.keys[i], k], dim=2)
            cache.values[i] = torch.cat([cache.values[i], v], dim=2)

    @torch.no_grad()
    def draft_block(self, cache: DFlashCache, anchor_ids: torch.Tensor) -> DFlashBlockOutput:
        """Draft the block after every cached context entry: the anchor sits at position ``cache.length``.

        Args:
            cache: context of positions 0..S-1 (unchanged).
            anchor_ids: (B,) the newest committed token (the root of the next verification block).

        Returns:
            :class:`DFlashBlockOutput` with N = 1: logits (B, 1, K, V), hidden (B, 1, K, H), vh_logits or None.
        """
        B, Bs = anchor_ids.shape[0], self.config.block_size
        block_ids = self.block_input(anchor_ids)  # (B, Bs)
        positions = cache.length + torch.arange(Bs, device=anchor_ids.device).expand(B, Bs)
        normed = self.run_block(block_ids, positions, list(zip(cache.keys, cache.values)))  # (B, Bs, H)
        logits, vh = self.readout(normed[:, None, 1:])
        return DFlashBlockOutput(logits=logits, hidden=normed[:, None, 1:], vh_logits=vh)


# ----------------------------------------------------------------------------------------------------------------------
# Training anchors
# ----------------------------------------------------------------------------------------------------------------------


def sample_block_anchors(
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    block_size: int,
    num_anchors: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Up to ``num_anchors`` distinct random anchors per row from loss-masked positions (SpecForge's rule).

    An anchor is a real, loss-masked position t with ``1 <= t <= T - block_size`` (T = the batch's padded length):
    the anchor token is an assistant token, it has context before it, and its block fits the batch.

    Args:
        loss_mask: (B, T) 1 on assistant tokens.
        attention_mask: (B, T) 1 on real tokens.
        block_size: tokens per block.
        num_anchors: at most this many per row.
        generator: a CPU ``torch.Generator`` (seeded by the caller for reproducible, resumable runs).

    Returns:
        (B, N) int64 anchors, ascending per row, ``-1`` padding; N = the largest row's count (0 when none).
    """
    B, T = loss_mask.shape
    t = torch.arange(T)
    eligible = loss_mask.bool().cpu() & attention_mask.bool().cpu() & (t >= 1) & (t <= T - block_size)  # (B, T)
    keys = torch.rand(B, T, generator=generator)  # (B, T)
    keys = torch.where(eligible, keys, torch.full_like(keys, 2.0))  # ineligible positions sort last
    order = keys.argsort(dim=1)  # (B, T)
    counts = eligible.sum(dim=1).clamp(max=num_anchors)  # (B,)
    N = int(counts.max()) if B else 0
    picked = order[:, :N]  # (B, N)
    keep = torch.arange(N)[None, :] < counts[:, None]  # (B, N)
    picked = torch.where(keep, picked, torch.full_like(picked, T + 1))
    anchors = picked.sort(dim=1).values  # real anchors first, ascending
    return torch.where(anchors > T, torch.full_like(anchors, -1), anchors).to(loss_mask.device)


# ----------------------------------------------------------------------------------------------------------------------
# Slow reference (tests only)
# ----------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def block_reference_forward(
    model: DFlashDrafter,
    aux_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
) -> DFlashBlockOutput:
    """The convention of :meth:`DFlashDrafter.forward` as an obvious loop over rows and anchors.

    Each block is drafted alone: its context is recomputed from ``aux_hidden[b, :anchor]`` only, its queries attend
    [that context ; its own block] with explicit dot products and softmax per head, no mask anywhere. Padding
    anchors (-1) are left zero. O(B N) module calls: tests only.
    """
    cfg = model.config
    B, N = anchors.shape
    K, Bs = cfg.num_slots, cfg.block_size
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    scale = 1.0 / math.sqrt(cfg.head_dim)
    logits = torch.zeros(B, N, K, cfg.vocab_size)
    hidden = torch.zeros(B, N, K, cfg.hidden_size)
    vh = torch.zeros(B, N, K)
    for b in range(B):
        for n in range(N):
            a = int(anchors[b, n])
            if a < 0:
                continue
            ctx = model.project_context(aux_hidden[b : b + 1, :a])  # (1, a, H)
            cos_c, sin_c = rope_cos_sin(torch.arange(a)[None], cfg.head_dim, cfg.rope_theta, ctx.dtype)
            x = model._embed(model.block_input(input_ids[b, a].view(1)))  # (1, Bs, H)
            cos_b, sin_b = rope_cos_sin(torch.arange(a, a + Bs)[None], cfg.head_dim, cfg.rope_theta, ctx.dtype)
            for layer in model.layers:
                attn_mod = layer.self_attn
                h = layer.input_layernorm(x)
                q = attn_mod.queries(h, cos_b, sin_b)[0]  # (nh, Bs, hd)
                kc, vc = attn_mod.keys_values(ctx, cos_c, sin_c)  # (1, nkv, a, hd)
                kb, vb = attn_mod.keys_values(h, cos_b, sin_b)  # (1, nkv, Bs, hd)
                keys = torch.cat([kc[0], kb[0]], dim=1)  # (nkv, a + Bs, hd)
                values = torch.cat([vc[0], vb[0]], dim=1)
                heads = []
                for i in range(cfg.num_attention_heads):
                    rows = []
                    for s in range(Bs):
                        scores = (keys[i // groups] @ q[i, s]) * scale  # (a + Bs,)
                        rows.append(torch.softmax(scores, dim=0) @ values[i // groups])  # (hd,)
                    heads.append(torch.stack(rows))  # (Bs, hd)
                out = torch.stack(heads)  # (nh, Bs, hd)
                x = x + attn_mod.o_proj(out.transpose(0, 1).reshape(1, Bs, -1))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            normed = model.norm(x)[0, 1:]  # (K, H)
            hidden[b, n] = normed
            logits[b, n] = model.lm_head(normed)
            if model.verification_head is not None:
                vh[b, n] = model.verification_head(normed).squeeze(-1)
    return DFlashBlockOutput(logits=logits, hidden=hidden, vh_logits=vh if model.verification_head is not None else None)


__all__ = [
    "DFlashAttention",
    "DFlashBlockOutput",
    "DFlashCache",
    "DFlashConfig",
    "DFlashDecoderLayer",
    "DFlashDrafter",
    "FrozenLMHead",
    "block_reference_forward",
    "check_dflash_matches_target",
    "default_target_layer_ids",
    "sample_block_anchors",
]
