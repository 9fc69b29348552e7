"""EAGLE-3 draft head: config, model, training-time-test (TTT) forward, KV-cached inference, draft-vocab helpers.

Architecture (docs/vat_losses.md; identical to EAGLE / SpecForge / SGLang ``LlamaForCausalLMEagle3``)::

    aux = cat(h_low, h_mid, h_high)                       # (B, T, 3*H_t)  target layer outputs (vat convention)
    [norm_before_fc: RMSNorm(3*H_t) | fc_norm: RMSNorm(H_t) per chunk]
    g   = fc(aux)                                         # (B, T, H)      Linear(3*H_t -> H, bias=False)
    per TTT step k:
        e = embed(token)                                  # frozen copy of the target's embedding
        x = cat(input_layernorm(e), hidden_norm(g))       # (B, T, 2H)     embedding FIRST
        h = r + o_proj(attn(q/k/v_proj(x)))               # r = g, or hidden_norm(g) when norm_before_residual
        h = h + mlp(post_attention_layernorm(h))          # pre-norm hidden
        logits = lm_head(norm(h))                         # (B, T, V_d)    draft vocabulary
        g = h, or norm(h) when norm_output                # the recurrent state fed to step k+1
    attention: causal over the prefix (within ``sliding_window`` when set) + the anchor's own chain

Every flag computes what speculators' ``Eagle3DraftModel`` computes (``docs/export.md`` §5).

State-dict names are SGLang's (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; plus ``input_norm`` /
``fc_norm.{i}`` when enabled and ``verification_head.*``), so exporting is a rename at most. The embedding is a
non-persistent buffer: never in ``state_dict()``, never a parameter, never saved.

Aux-layer ids are in **vat's convention: 0-indexed decoder-layer outputs** (``hidden_states[i + 1]`` of HF
``output_hidden_states``). SGLang's draft config uses the same numbers; vLLM / speculators use ``i + 1``
(see ``docs/export.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from vat.drafters.common import DraftInputs, RMSNorm, masked_attention, rope_cos_sin
from vat.drafters.eagle3_config import NUM_AUX_LAYERS, VH_INPUTS, Eagle3Config, check_draft_matches_target
from vat.drafters.eagle3_layer import Eagle3Attention, Eagle3DecoderLayer, FrozenEmbedding
from vat.drafters.sparse_attention import attention_with_private_keys, flex_ttt_attention, resolve_attention_impl
from vat.errors import VatError, require_file
from vat.target.conventions import default_aux_layer_ids

# the verification head starts as the constant prior P(accept) = 0.2 (zero weight): before it has learned anything
# it sends no gradient into the draft body, and its BCE starts near the entropy of a typical acceptance rate
VH_PRIOR = 0.2


# ----------------------------------------------------------------------------------------------------------------------
# Draft vocabulary helpers (d2t: offsets, t2d: bool mask; EAGLE / SpecForge / SGLang / vLLM convention)
# ----------------------------------------------------------------------------------------------------------------------


def identity_vocab_mapping(vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mapping "draft id i = target id i" for the first ``draft_vocab_size`` ids: ``d2t`` zeros, ``t2d`` prefix."""
    d2t = torch.zeros(draft_vocab_size, dtype=torch.long)
    t2d = torch.arange(vocab_size) < draft_vocab_size
    return d2t, t2d


def validate_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> None:
    """Raise :class:`VatError` unless ``d2t`` (V_d,) offsets and ``t2d`` (V,) bool describe the same sorted id set."""
    if tuple(d2t.shape) != (draft_vocab_size,):
        raise VatError(f"d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab_size},) = (draft_vocab_size,)")
    if tuple(t2d.shape) != (vocab_size,):
        raise VatError(f"t2d has shape {tuple(t2d.shape)}, expected ({vocab_size},) = (vocab_size,)")
    used = d2t.long().cpu() + torch.arange(draft_vocab_size)
    if not torch.equal(used, torch.nonzero(t2d.bool().cpu()).flatten()):
        raise VatError(
            "d2t and t2d disagree: d2t + arange must list, in ascending order, exactly the ids where t2d is set"
        )


def map_draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Draft-vocab ids (any shape) -> target-vocab ids: ``ids + d2t[ids]``."""
    return draft_ids + d2t[draft_ids]


def in_draft_vocab(token_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Bool mask (same shape as ``token_ids``): True where the target-vocab token is in the draft vocab."""
    return t2d[token_ids]


def draft_vocab_position_mask(target_logits: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """(…, V) target logits -> (…) bool, True where the target's argmax token is in the draft vocab.

    EAGLE / SpecForge drop the other positions from the loss (``position_mask = t2d[argmax] * loss_mask``).
    """
    return t2d[target_logits.argmax(dim=-1)]


def target_probs_on_draft_vocab(target_logits: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """The target distribution restricted to the draft vocab and renormalised: softmax over ``logits[..., t2d]``.

    Args:
        target_logits: (…, V) target logits.
        t2d: (V,) bool draft-vocab mask.

    Returns:
        (…, V_d) fp32 probabilities, draft-id order (ascending target id, as d2t).
    """
    return torch.softmax(target_logits[..., t2d].float(), dim=-1)


def map_draft_probs_to_target(probs: torch.Tensor, d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(…, V_d) draft-vocab probabilities -> (…, V) over the target vocab (zero outside the draft vocab)."""
    target_ids = d2t + torch.arange(d2t.shape[0], device=d2t.device)  # (V_d,)
    out = probs.new_zeros(*probs.shape[:-1], vocab_size)
    out[..., target_ids] = probs
    return out


def load_vocab_mapping(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``d2t`` (int64 (V_d,) offsets) and ``t2d`` (bool (V,)) from a ``vat prep vocab`` safetensors file."""
    tensors = load_file(require_file(path, "draft vocab file"))
    missing = [k for k in ("d2t", "t2d") if k not in tensors]
    if missing:
        raise VatError(f"draft vocab file {path} lacks {missing}")
    d2t, t2d = tensors["d2t"].long(), tensors["t2d"].bool()
    validate_vocab_mapping(d2t, t2d, t2d.shape[0], d2t.shape[0])
    return d2t, t2d


# ----------------------------------------------------------------------------------------------------------------------
# TTT alignment helpers
# ----------------------------------------------------------------------------------------------------------------------


def shift_for_ttt(x: torch.Tensor, ttt_steps: int, fill_value: float = 0) -> torch.Tensor:
    """Align per-position tensors with the TTT output: ``out[:, t, k] = x[:, t + 1 + k]`` (``fill_value`` past the end).

    Use it on whatever step (t, k) is compared with: target logits / probabilities (index t+1+k), the loss mask, ...
    Prefer restricting target logits to the draft vocab first: the result is K times the input.

    Args:
        x: (B, T, ...) per-position tensor.
        ttt_steps: K.
        fill_value: value for positions past the end of the row.

    Returns:
        (B, T, K, ...) tensor.
    """
    B, T = x.shape[:2]
    out = x.new_full((B, T, ttt_steps, *x.shape[2:]), fill_value)
    for k in range(ttt_steps):
        n = T - 1 - k
        if n > 0:
            out[:, :n, k] = x[:, 1 + k :]
    return out


def ttt_valid_mask(attention_mask: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """(B, T) padding mask -> (B, T, K) bool: step k at anchor t is real iff positions t .. t+1+k are all real.

    Position t+1+k holds the step's input token and the target distribution it is compared with. The loss mask and
    the draft-vocab mask are separate (the losses combine them).
    """
    real = attention_mask.bool()
    valid = shift_for_ttt(real, ttt_steps, fill_value=False)  # (B, T, K): position t+1+k real
    valid = torch.cumprod(valid.long(), dim=2).bool()  # and every position before it in the chain
    return valid & real.unsqueeze(-1)


@dataclass
class Eagle3TTTOutput:
    """Result of :meth:`Eagle3Drafter.ttt_forward`; index ``[b, t, k]`` = anchor t, TTT step k.

    Attributes:
        logits: (B, T, K, V_d) draft logits; step k at anchor t predicts token t+2+k (target logits index t+1+k).
        hidden: (B, T, K, H) the recurrent state that feeds step k+1: the pre-norm hidden h, or ``norm(h)`` when
            ``norm_output``.
        vh_logits: (B, T, K) verification-head logits (apply sigmoid), or None without a head.
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    vh_logits: torch.Tensor | None = None


@dataclass
class Eagle3StepOutput:
    """Result of :meth:`Eagle3Drafter.step` for n new entries.

    Attributes:
        hidden: (B, n, H) the recurrent state (pre-norm hidden, or ``norm(h)`` when ``norm_output``).
        logits: (B, n, V_d) draft logits.
        vh_logits: (B, n) verification-head logits, or None.
    """

    hidden: torch.Tensor
    logits: torch.Tensor
    vh_logits: torch.Tensor | None = None


@dataclass
class Eagle3Draft:
    """A drafted chain from :meth:`Eagle3Drafter.draft_chain`.

    Attributes:
        token_ids: (B, K) drafted tokens in the TARGET vocabulary (mapped through d2t).
        draft_token_ids: (B, K) the same tokens as draft-vocab ids.
        logits: (B, K, V_d) draft logits of each step.
        probs: (B, K, V_d) the distribution each token was drawn from (softmax(logits / temperature); plain softmax
            when greedy). Map to the target vocab with :func:`map_draft_probs_to_target`.
        vh_probs: (B, K) verification-head acceptance probabilities, or None without a head.
    """

    token_ids: torch.Tensor
    draft_token_ids: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor
    vh_probs: torch.Tensor | None = None


@dataclass
class Eagle3KVCache:
    """The draft's own KV cache for inference (one decoder layer).

    Slots are appended for all rows at once; ``valid`` marks real entries so rows may advance by different amounts
    (ragged extends). Each slot stores its RoPE position.

    Attributes:
        key: (B, H_kv, S, hd) rotated keys.
        value: (B, H_kv, S, hd) values.
        valid: (B, S) bool, True for real entries.
        positions: (B, S) long RoPE positions of the entries.
    """

    key: torch.Tensor
    value: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor

    @property
    def length(self) -> int:
        """Number of slots S (the same for every row)."""
        return self.key.shape[2]

    def next_positions(self) -> torch.Tensor:
        """(B,) position of the next entry per row: one past the last valid entry's position (0 when empty)."""
        pos = torch.where(self.valid, self.positions, torch.full_like(self.positions, -1))
        return (pos.max(dim=1).values + 1) if self.length else self.positions.new_zeros(self.positions.shape[0])

    def crop(self, length: int) -> None:
        """Keep the first ``length`` slots (discard the entries of rejected / speculative steps)."""
        self.key = self.key[:, :, :length]
        self.value = self.value[:, :, :length]
        self.valid = self.valid[:, :length]
        self.positions = self.positions[:, :length]

    def append(self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> None:
        """Append n slots: key/value (B, H_kv, n, hd), valid/positions (B, n)."""
        self.key = torch.cat([self.key, key], dim=2)
        self.value = torch.cat([self.value, value], dim=2)
        self.valid = torch.cat([self.valid, valid], dim=1)
        self.positions = torch.cat([self.positions, positions], dim=1)


class Eagle3Drafter(DraftInputs, nn.Module):
    """The EAGLE-3 draft head (see the module docstring for the graph and naming).

    Args:
        config: the draft config.
        embed_weight: (V, H) the target's input-embedding table (shared, frozen, never saved, not moved by ``.to()``).
            May be omitted and set later with :meth:`set_embedding` (e.g. after :func:`vat.export.load_draft`).
    """

    def __init__(self, config: Eagle3Config, embed_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg = config
        h_t = cfg.target_hidden_size
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(NUM_AUX_LAYERS * h_t, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(h_t, cfg.rms_norm_eps) for _ in range(NUM_AUX_LAYERS)])
        self.fc = nn.Linear(NUM_AUX_LAYERS * h_t, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.verification_head = nn.Linear(cfg.hidden_size, 1) if cfg.verification_head else None
        if self.verification_head is not None:
            self.reset_verification_head()
        d2t, t2d = identity_vocab_mapping(cfg.vocab_size, cfg.draft_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        object.__setattr__(self, "_embedding", None)  # unregistered on purpose (see FrozenEmbedding)
        if embed_weight is not None:
            self.set_embedding(embed_weight)

    # -- set-up ---------------------------------------------------------------------------------------------------

    def set_embedding(self, weight: torch.Tensor) -> None:
        """Attach the target's (V, H) input-embedding table (frozen; shared storage; not saved)."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise VatError(f"embedding has shape {tuple(weight.shape)}, the draft expects {expected} (vocab, hidden)")
        object.__setattr__(self, "_embedding", FrozenEmbedding(weight))

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary: ``d2t`` int64 (V_d,) offsets and ``t2d`` bool (V,) (validated)."""
        validate_vocab_mapping(d2t, t2d, self.config.vocab_size, self.config.draft_vocab_size)
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    def map_draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target-vocab ids (via ``d2t``)."""
        return map_draft_to_target(draft_ids, self.d2t)

    # -- shared pieces --------------------------------------------------------------------------------------------

    def project_aux(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, 3*H_t) concatenated aux states -> (B, T, H) via the optional norms and ``fc``."""
        x = aux_hidden.to(self._dtype)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        elif self.config.fc_norm:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(NUM_AUX_LAYERS, dim=-1))], dim=-1)
        return self.fc(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden (…, H) -> draft logits (…, V_d)."""
        return self.lm_head(self.norm(hidden))

    def readout(
        self, hidden: torch.Tensor, vh_detach: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The layer's pre-norm output h (…, H) -> (recurrent state (…, H), logits (…, V_d), VH logits (…,) or None).

        The state fed to the next step is h, or ``norm(h)`` when ``norm_output`` (speculators: "feed post-norm hidden
        states back across TTT steps"); the logits read ``norm(h)`` either way, so they do not depend on the flag.
        """
        normed = self.norm(hidden)
        state = normed if self.config.norm_output else hidden
        vh = None
        if self.verification_head is not None:
            x = normed if self.config.vh_input == "normed" else hidden
            vh = self.verification_head(x.detach() if vh_detach else x).squeeze(-1)
        return state, self.lm_head(normed), vh

    @torch.no_grad()
    def reset_verification_head(self) -> None:
        """Zero weight and bias logit(``VH_PRIOR``): the head predicts the prior and sends no gradient into the body."""
        self.verification_head.weight.zero_()
        self.verification_head.bias.fill_(math.log(VH_PRIOR / (1.0 - VH_PRIOR)))

    def verification_logits(self, hidden: torch.Tensor, detach: bool = False) -> torch.Tensor:
        """Pre-norm hidden (…, H) -> verification-head logits (…,).

        The head reads ``norm(hidden)``, what ``lm_head`` reads (``vh_input="normed"``), or the pre-norm residual
        itself (``"prenorm"``, older checkpoints), whose scale grows with depth and training and whose weight gradient
        swamped a shared gradient clip. ``detach=True`` reads a detached hidden state: the head's loss then trains the
        head only, not the draft body (``loss.vh_detach``).
        """
        if self.verification_head is None:
            raise VatError("this draft has no verification head (drafter.verification_head=false)")
        x = self.norm(hidden) if self.config.vh_input == "normed" else hidden
        return self.verification_head(x.detach() if detach else x).squeeze(-1)  # detach after the shared norm too

    # -- training-time test ---------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Eagle3TTTOutput:
        """The training forward is the TTT unroll (so DDP/FSDP wrappers run it): see :meth:`ttt_forward`."""
        return self.ttt_forward(*args, **kwargs)

    def ttt_forward(
        self,
        aux_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        ttt_steps: int | None = None,
        position_ids: torch.Tensor | None = None,
        vh_detach: bool = False,
        attention: str = "auto",
    ) -> Eagle3TTTOutput:
        """Unrolled training-time test over every anchor of the batch at once.

        Convention (the losses and trainer rely on it): anchor t is a position whose target features are used.

        * Step 0 at anchor t consumes ``fc(aux_t)`` and the embedding of token t+1 and predicts token t+2: compare
          ``logits[:, t, 0]`` with the target distribution at logits index t+1.
        * Step k consumes the draft's own state at (t, k-1) (pre-norm h, or norm(h) when ``norm_output``) and the teacher-forced token t+1+k, and
          predicts token t+2+k (target logits index t+1+k). Tokens past the end of a row are ``pad_token_id``
          (mask those steps with :func:`ttt_valid_mask`; align targets with :func:`shift_for_ttt`).
        * Attention of query (t, k): the step-0 keys (s, 0) for s <= t whose ``attention_mask`` is 1 (causal over the
          real prefix; (t, 0) itself is always allowed so padded queries stay finite), plus the diagonal keys
          (t, j) for 1 <= j <= k (its own chain, including itself). ``attention="dense"`` is SDPA over the
          concatenation of the per-step keys with a (T, (k+1)T) boolean mask (the reference); ``"blockwise"``
          scores the step-0 block with one masked matmul and the chain keys per anchor under one softmax
          (:mod:`vat.drafters.sparse_attention`: T^2 + kT scores at step k instead of (k+1)T^2). With ``sliding_window`` W the step-0 keys are further
          limited to t - s < W (speculators' training mask, by anchor index); the chain keys always stay. The
          KV-cache path (:meth:`step`) windows by RoPE position instead, as serving engines do, so for k > 0 the two
          differ only at the window's edge (k keys of a W-long prefix).
        * RoPE positions (SpecForge): queries and keys of step k are rotated at ``position_ids + k``
          (default ``position_ids = arange(T)``), so step-0 keys keep position s and (t, j) sits at t + j — exactly
          the positions the KV-cache inference path gives the same entries.

        Args:
            aux_hidden: (B, T, 3*H_t) target aux states at every position (vat aux-layer order).
            input_ids: (B, T) token ids (target vocab).
            attention_mask: (B, T) 1 = real token, 0 = padding; None = all real.
            ttt_steps: K; None = ``config.ttt_steps``.
            position_ids: (B, T) RoPE positions of step 0; None = ``arange(T)``.
            vh_detach: the verification head reads detached hidden states (``loss.vh_detach``).
            attention: ``auto`` (blockwise on CPU, dense elsewhere), ``dense``, ``blockwise`` or ``flex``
                (flex_attention with a block mask of the same rule; CUDA).

        Returns:
            :class:`Eagle3TTTOutput` with logits (B, T, K, V_d), hidden (B, T, K, H), vh_logits (B, T, K) or None.
        """
        K = ttt_steps or self.config.ttt_steps
        B, T = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.bool, device=device)
        if position_ids is None:
            position_ids = torch.arange(T, device=device).expand(B, T)

        eye = torch.eye(T, dtype=torch.bool, device=device)
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        if self.config.sliding_window is not None:  # speculators: kv > q - window over the step-0 block
            idx = torch.arange(T, device=device)
            causal = causal & ((idx[:, None] - idx[None, :]) < self.config.sliding_window)
        block0 = causal & (attention_mask.bool()[:, None, :] | eye)  # (B, T, T) step-0 keys
        diag = eye.expand(B, T, T)

        impl = resolve_attention_impl(attention, device)
        hidden = self.project_aux(aux_hidden)  # (B, T, H)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        mask = block0
        logits, hiddens, vh = [], [], []
        for k in range(K):
            ids_k = F.pad(input_ids[:, 1 + k :], (0, min(1 + k, T)), value=self.config.pad_token_id)  # (B, T): t+1+k
            x, residual = self.midlayer.attention_input(self._embed(ids_k), hidden)  # (B, T, 2H)
            cos, sin = self._rope(position_ids + k)
            q, key, value = self.midlayer.self_attn.qkv(x, cos, sin)
            keys.append(key)
            values.append(value)
            if impl == "flex":
                attn = flex_ttt_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attention_mask,
                                          self.config.sliding_window)
            elif impl == "blockwise" and k > 0:  # the chain (t, 1..k): k keys private to anchor t
                chain_k = torch.stack(keys[1:], dim=3)  # (B, nkv, T, k, hd)
                chain_v = torch.stack(values[1:], dim=3)
                attn = attention_with_private_keys(q, keys[0], values[0], block0.unsqueeze(1), chain_k, chain_v)
            else:
                if k > 0:
                    mask = torch.cat([mask, diag], dim=-1)  # (B, T, (k+1)T)
                attn = masked_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask.unsqueeze(1))
            hidden, step_logits, step_vh = self.readout(self.midlayer.output(attn, residual), vh_detach)
            hiddens.append(hidden)  # (B, T, H) the state that feeds step k+1
            logits.append(step_logits)  # (B, T, V_d)
            if step_vh is not None:
                vh.append(step_vh)  # (B, T)
        return Eagle3TTTOutput(
            logits=torch.stack(logits, dim=2),  # (B, T, K, V_d)
            hidden=torch.stack(hiddens, dim=2),  # (B, T, K, H)
            vh_logits=torch.stack(vh, dim=2) if vh else None,  # (B, T, K)
        )

    # -- inference with a KV cache --------------------------------------------------------------------------------

    def new_cache(self, batch_size: int, device: torch.device | None = None) -> Eagle3KVCache:
        """An empty :class:`Eagle3KVCache` for ``batch_size`` rows."""
        device = device or self.fc.weight.device
        cfg = self.config
        kv = torch.zeros(batch_size, cfg.num_key_value_heads, 0, cfg.head_dim, dtype=self._dtype, device=device)
        return Eagle3KVCache(
            key=kv,
            value=kv.clone(),
            valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=device),
            positions=torch.zeros(batch_size, 0, dtype=torch.long, device=device),
        )

    def step(
        self,
        cache: Eagle3KVCache,
        input_ids: torch.Tensor,
        *,
        aux_hidden: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        input_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> Eagle3StepOutput:
        """Run n new entries through the draft, attending to the cache, and append them to the cache.

        An entry is (hidden input, token): either target features (``aux_hidden``; entry s pairs the target's aux
        state at position s with token s+1) or the draft's own pre-norm hidden state (``hidden``; a chain / tree step
        fed its parent's hidden and the parent's drafted token).

        Args:
            cache: the draft KV cache (modified in place).
            input_ids: (B, n) tokens (target vocab).
            aux_hidden: (B, n, 3*H_t) target aux states; exactly one of ``aux_hidden`` / ``hidden``.
            hidden: (B, n, H) draft pre-norm hidden states.
            input_mask: (B, n) bool, False for padding entries of a ragged extend (stored as invalid); None = all real.
            position_ids: (B, n) RoPE positions; None = consecutive after each row's last valid entry.
            attention_mask: (B, n, S + n) bool over [cache slots, new entries], True = may attend (tree drafting);
                None = every valid cache slot + causal over the valid new entries. Each entry always sees itself.

        Returns:
            :class:`Eagle3StepOutput` with hidden (B, n, H), logits (B, n, V_d) and vh_logits (B, n) or None.
        """
        if (aux_hidden is None) == (hidden is None):
            raise ValueError("pass exactly one of aux_hidden (target features) or hidden (draft state)")
        B, n = input_ids.shape
        device = input_ids.device
        S = cache.length
        if input_mask is None:
            input_mask = torch.ones(B, n, dtype=torch.bool, device=device)
        input_mask = input_mask.bool()
        if position_ids is None:
            position_ids = cache.next_positions()[:, None] + (input_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        eye = torch.eye(n, dtype=torch.bool, device=device)
        if attention_mask is None:
            new = torch.ones(n, n, dtype=torch.bool, device=device).tril() & input_mask[:, None, :]  # (B, n, n)
            attention_mask = torch.cat([cache.valid[:, None, :].expand(B, n, S), new], dim=-1)  # (B, n, S + n)
        self_slot = torch.cat([torch.zeros(n, S, dtype=torch.bool, device=device), eye], dim=-1)  # (n, S + n)
        attention_mask = attention_mask.bool() | self_slot

        g = self.project_aux(aux_hidden) if aux_hidden is not None else hidden.to(self._dtype)  # (B, n, H)
        x, residual = self.midlayer.attention_input(self._embed(input_ids), g)  # (B, n, 2H)
        cos, sin = self._rope(position_ids)
        q, key, value = self.midlayer.self_attn.qkv(x, cos, sin)
        cache.append(key, value, input_mask, position_ids)
        if self.config.sliding_window is not None:  # serving engines window by position: q_pos - k_pos < window
            window = (position_ids[:, :, None] - cache.positions[:, None, :]) < self.config.sliding_window
            attention_mask = (attention_mask & window) | self_slot  # (B, n, S + n)
        attn = masked_attention(q, cache.key, cache.value, attention_mask.unsqueeze(1))  # (B, nh, n, hd)
        hidden, logits, vh = self.readout(self.midlayer.output(attn, residual))  # (B, n, H), (B, n, V_d), (B, n)
        return Eagle3StepOutput(hidden=hidden, logits=logits, vh_logits=vh)

    @torch.no_grad()
    def draft_chain(
        self,
        cache: Eagle3KVCache,
        aux_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        num_steps: int,
        *,
        input_mask: torch.Tensor | None = None,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        keep_chain_kv: bool = False,
    ) -> Eagle3Draft:
        """Extend the cache with newly verified target features, then draft a chain of ``num_steps`` tokens.

        Usage in a speculative-decoding loop (prompt x_0..x_{n-1}; the target's bonus token x_n)::

            cache = draft.new_cache(B)
            d = draft.draft_chain(cache, aux[:, 0:n], x[:, 1:n+1], K)      # entries (aux_s, x_{s+1}), s < n
            ... target verifies x_n, d.token_ids; accepts a drafts + bonus token b ...
            d = draft.draft_chain(cache, aux_new, tokens_new, K)            # aux at positions n..n+a with
                                                                            # tokens [d_0..d_{a-1}, b]
        The step-0 entry (computed from target features) stays in the cache; the entries of steps 1..K-1 are
        speculative and are cropped before returning unless ``keep_chain_kv`` (then ``cache.crop`` them yourself).

        Args:
            cache: the draft KV cache (modified in place).
            aux_hidden: (B, n, 3*H_t) target aux states of the newly accepted positions.
            input_ids: (B, n) the token FOLLOWING each of those positions (target vocab).
            num_steps: K, tokens to draft.
            input_mask: (B, n) bool for ragged extends (rows that accepted fewer tokens; each row's valid entries
                first); None = all real.
            temperature: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature).
            generator: random generator for sampling.
            keep_chain_kv: keep the speculative entries of steps 1..K-1 in the cache.

        Returns:
            :class:`Eagle3Draft` with token_ids (B, K) in the target vocab, draft ids, logits, probs (B, K, V_d) and
            vh_probs (B, K) or None.
        """
        B, n = input_ids.shape
        if input_mask is None:
            input_mask = torch.ones(B, n, dtype=torch.bool, device=input_ids.device)
        out = self.step(cache, input_ids, aux_hidden=aux_hidden, input_mask=input_mask)
        last = (input_mask.long().sum(dim=1) - 1).clamp(min=0)  # (B,) last valid new entry per row
        rows = torch.arange(B, device=input_ids.device)
        hidden, logits = out.hidden[rows, last], out.logits[rows, last]  # (B, H), (B, V_d)
        vh = out.vh_logits[rows, last] if out.vh_logits is not None else None  # (B,)
        prefix_length = cache.length

        all_logits, all_probs, all_ids, all_vh = [], [], [], []
        for k in range(num_steps):
            if temperature > 0:
                probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V_d)
                draft_ids = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            else:
                probs = torch.softmax(logits.float(), dim=-1)
                draft_ids = logits.argmax(dim=-1)  # (B,)
            all_logits.append(logits)
            all_probs.append(probs)
            all_ids.append(draft_ids)
            if vh is not None:
                all_vh.append(torch.sigmoid(vh.float()))
            if k == num_steps - 1:
                break
            out = self.step(cache, self.map_draft_to_target(draft_ids)[:, None], hidden=hidden[:, None])
            hidden, logits = out.hidden[:, 0], out.logits[:, 0]
            vh = out.vh_logits[:, 0] if out.vh_logits is not None else None
        if not keep_chain_kv:
            cache.crop(prefix_length)
        draft_ids = torch.stack(all_ids, dim=1)  # (B, K)
        return Eagle3Draft(
            token_ids=self.map_draft_to_target(draft_ids),
            draft_token_ids=draft_ids,
            logits=torch.stack(all_logits, dim=1),  # (B, K, V_d)
            probs=torch.stack(all_probs, dim=1),  # (B, K, V_d)
            vh_probs=torch.stack(all_vh, dim=1) if all_vh else None,  # (B, K)
        )


# ----------------------------------------------------------------------------------------------------------------------
# Slow reference (tests only)
# ----------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def ttt_reference_forward(
    model: Eagle3Drafter,
    aux_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    ttt_steps: int | None = None,
) -> Eagle3TTTOutput:
    """The TTT convention of :meth:`Eagle3Drafter.ttt_forward` as an obvious loop over rows, anchors and steps.

    Each (b, t, k) recomputes its query, the step-0 keys of the prefix and its own chain keys from scratch and does
    attention with explicit dot products and softmax. O(B T^2 K) module calls: tests only.
    """
    cfg = model.config
    K = ttt_steps or cfg.ttt_steps
    B, T = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones(B, T, dtype=torch.long)
    layer = model.midlayer
    attn_mod = layer.self_attn
    groups = attn_mod.num_heads // attn_mod.num_kv_heads
    scale = 1.0 / math.sqrt(attn_mod.head_dim)

    def token(b: int, i: int) -> torch.Tensor:
        return input_ids[b, i : i + 1] if i < T else torch.tensor([cfg.pad_token_id], device=input_ids.device)

    def entry(g: torch.Tensor, tok: torch.Tensor, pos: int):
        """One entry (hidden (H,), token (1,), position) -> q (nh, hd), k (nkv, hd), v (nkv, hd), residual (H,)."""
        x, residual = layer.attention_input(model._embed(tok[None]), g[None, None])
        cos, sin = rope_cos_sin(torch.tensor([[pos]], device=g.device), cfg.head_dim, cfg.rope_theta, g.dtype)
        q, k, v = attn_mod.qkv(x, cos, sin)  # (1, heads, 1, hd)
        return q[0, :, 0], k[0, :, 0], v[0, :, 0], residual[0, 0]

    logits = torch.zeros(B, T, K, cfg.draft_vocab_size)
    hiddens = torch.zeros(B, T, K, cfg.hidden_size)
    vh = torch.zeros(B, T, K)
    g0 = model.project_aux(aux_hidden)  # (B, T, H)
    for b in range(B):
        for t in range(T):
            # Step-0 keys of the real prefix s <= t (the anchor's own entry always).
            window = cfg.sliding_window or T + 1
            prefix = [
                entry(g0[b, s], token(b, s + 1), s)
                for s in range(t + 1)
                if (attention_mask[b, s] or s == t) and t - s < window
            ]
            chain: list[tuple[torch.Tensor, torch.Tensor]] = []
            g = g0[b, t]
            for k in range(K):
                q, key, value, residual = entry(g, token(b, t + 1 + k), t + k)
                if k > 0:
                    chain.append((key, value))
                ks = torch.stack([e[1] for e in prefix] + [c[0] for c in chain])  # (S, nkv, hd)
                vs = torch.stack([e[2] for e in prefix] + [c[1] for c in chain])
                heads = []
                for h in range(attn_mod.num_heads):
                    scores = (ks[:, h // groups] @ q[h]) * scale  # (S,)
                    heads.append(torch.softmax(scores, dim=0) @ vs[:, h // groups])  # (hd,)
                attn = torch.stack(heads)[None, :, None]  # (1, nh, 1, hd)
                h = layer.output(attn, residual[None, None])[0, 0]  # (H,) pre-norm
                g = model.norm(h) if cfg.norm_output else h  # the state fed to the next step
                hiddens[b, t, k] = g
                logits[b, t, k] = model.compute_logits(h)
                if model.verification_head is not None:
                    vh[b, t, k] = model.verification_head(model.norm(h) if cfg.vh_input == "normed" else h)[0]
    return Eagle3TTTOutput(logits=logits, hidden=hiddens, vh_logits=vh if model.verification_head is not None else None)


__all__ = [
    "NUM_AUX_LAYERS",
    "VH_INPUTS",
    "Eagle3Attention",
    "Eagle3Config",
    "Eagle3DecoderLayer",
    "Eagle3Draft",
    "Eagle3Drafter",
    "Eagle3KVCache",
    "Eagle3StepOutput",
    "Eagle3TTTOutput",
    "FrozenEmbedding",
    "check_draft_matches_target",
    "default_aux_layer_ids",
    "draft_vocab_position_mask",
    "identity_vocab_mapping",
    "in_draft_vocab",
    "load_vocab_mapping",
    "map_draft_probs_to_target",
    "map_draft_to_target",
    "shift_for_ttt",
    "target_probs_on_draft_vocab",
    "ttt_reference_forward",
    "ttt_valid_mask",
    "validate_vocab_mapping",
]
