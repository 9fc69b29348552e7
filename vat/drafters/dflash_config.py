"""DFlash draft config: every field that defines a block drafter and the target it was built for, the default target
layers, the MASK token, and the check that a draft fits a target (docs/vat_losses.md, §10).

Field names follow the public DFlash release configs (``num_hidden_layers`` = draft decoder layers,
``target_layer_ids``, ``block_size``, ``mask_token_id``, ``num_target_layers``), so the checkpoint layout is a
straight copy (:mod:`vat.export.dflash`).

``target_layer_ids`` are in vat's convention, 0-indexed decoder-layer OUTPUTS, which is also DFlash's own
(``extract_context_feature`` reads ``hidden_states[id + 1]``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vat.drafters.common import check_config_keys, draft_dims_for_target
from vat.errors import VatError

MASK_TOKEN = "<|MASK|>"  # the token DFlash adds to a tokenizer that has none (Qwen3: id 151669)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default context layers: one per draft layer, spread uniformly from layer 1 to L - 3 (inclusive).

    Qwen3-8B (36 layers, 5 draft layers) gives ``[1, 9, 17, 25, 33]``; a 1-layer draft reads layer ``L // 2``.
    Ids are clamped into ``[0, L - 1]`` for targets with fewer than 4 layers.
    """
    if num_draft_layers == 1:
        ids = [num_target_layers // 2]
    else:
        start, end = 1, num_target_layers - 3
        ids = [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    return [min(max(i, 0), num_target_layers - 1) for i in ids]


@dataclass
class DFlashConfig:
    """Everything that defines a DFlash block drafter and the target it was built for.

    ``to_dict`` / ``from_dict`` round-trip through JSON; ``from_dict`` rejects unknown keys (naming the closest).
    ``head_dim`` and ``target_hidden_size`` left at ``None`` resolve in ``__post_init__``; ``target_layer_ids`` left
    at ``None`` resolves to :func:`default_target_layer_ids` when ``num_target_layers`` is known.
    """

    hidden_size: int = 4096  # draft hidden H = the target's (the draft reads its embedding and LM head)
    intermediate_size: int = 12288  # dense SwiGLU width of each draft layer
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None  # None = hidden_size // num_attention_heads
    num_hidden_layers: int = 5  # draft decoder layers
    target_hidden_size: int | None = None  # H_t of the context features; None = hidden_size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0  # default (unscaled) RoPE only
    max_position_embeddings: int = 40960  # written to the release config; no effect on vat's forward
    vocab_size: int = 151936  # the target's vocabulary (its embedding rows and LM head outputs)
    target_layer_ids: list[int] | None = None  # vat convention: 0-indexed layer OUTPUTS
    num_target_layers: int | None = None  # the target's decoder layers (validation, default layer ids)
    block_size: int = 16  # tokens per block: the anchor + block_size - 1 drafted tokens
    mask_token_id: int = 0  # the target tokenizer's MASK token (added if it had none)
    verification_head: bool = False  # Linear(H -> 1) + sigmoid on each slot's normed hidden state
    target_path: str | None = None  # the target this draft was trained for

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.num_attention_heads % self.num_key_value_heads:
            raise VatError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise VatError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_hidden_layers < 1:
            raise VatError(f"a DFlash draft needs at least one layer, got num_hidden_layers={self.num_hidden_layers}")
        if self.block_size < 2:
            raise VatError(f"block_size must be >= 2 (the anchor plus at least one drafted token), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise VatError(f"mask_token_id {self.mask_token_id} is outside the target vocabulary (0..{self.vocab_size - 1})")
        if self.target_layer_ids is None and self.num_target_layers is not None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
            if not self.target_layer_ids:
                raise VatError("target_layer_ids is empty: DFlash reads at least one target layer")

    # names shared with the EAGLE-3 config, so the trainer, eval and checkpoint code read either
    @property
    def aux_layer_ids(self) -> list[int] | None:
        """The captured target layers (= ``target_layer_ids``)."""
        return self.target_layer_ids

    @property
    def draft_vocab_size(self) -> int:
        """DFlash predicts over the target's full vocabulary."""
        return self.vocab_size

    @property
    def num_slots(self) -> int:
        """Drafted tokens per block (``block_size - 1``): the K of verification and the losses."""
        return self.block_size - 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DFlashConfig:
        """Build from :meth:`to_dict` output; an unknown key raises :class:`VatError` naming the closest field."""
        check_config_keys(cls, data)
        return cls(**data)

    @classmethod
    def for_target(cls, target_config: Any, **overrides: Any) -> DFlashConfig:
        """A draft config sized from a transformers target config (dims, heads, RoPE, vocab, default layer ids).

        The shared dims (MLP width rule included) come from :func:`vat.drafters.common.draft_dims_for_target`.

        Args:
            target_config: the target's ``PretrainedConfig`` (text config for multimodal models).
            **overrides: any :class:`DFlashConfig` field, e.g. ``num_hidden_layers=5``, ``mask_token_id=151669``.
        """
        tc = getattr(target_config, "text_config", None) or target_config
        values: dict[str, Any] = draft_dims_for_target(tc)
        if getattr(tc, "mask_token_id", None) is not None:
            values["mask_token_id"] = int(tc.mask_token_id)
        values.update(overrides)
        return cls(**values)


def check_dflash_matches_target(
    cfg: DFlashConfig, target_hidden_size: int, target_vocab_size: int, num_target_layers: int
) -> list[int]:
    """Stop at once, with one clear line, when a DFlash draft was built for another target.

    Returns:
        The target layers to capture (vat convention), resolved to the DFlash default when the config has none.

    Raises:
        VatError: hidden size, vocabulary size or layer count differs, or a layer id is out of range.
    """
    where = f" (draft trained for {cfg.target_path})" if cfg.target_path else ""
    if cfg.target_hidden_size != target_hidden_size or cfg.hidden_size != target_hidden_size:
        raise VatError(
            f"DFlash draft expects target hidden size {cfg.target_hidden_size}, this target has {target_hidden_size}"
            f"{where}"
        )
    if cfg.vocab_size != target_vocab_size:
        raise VatError(f"draft expects target vocab size {cfg.vocab_size}, this target has {target_vocab_size}{where}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != num_target_layers:
        raise VatError(
            f"draft expects a target with {cfg.num_target_layers} layers, this target has {num_target_layers}{where}"
        )
    ids = cfg.target_layer_ids
    if ids is None:
        ids = default_target_layer_ids(num_target_layers, cfg.num_hidden_layers)
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise VatError(
            f"draft target layers {ids} (0-indexed layer outputs) out of range for a {num_target_layers}-layer "
            f"target: {bad}"
        )
    return list(ids)


def resolve_mask_token_id(tokenizer: Any, vocab_size: int) -> int:
    """The target tokenizer's MASK token id; a tokenizer without one gets :data:`MASK_TOKEN` added (DFlash's rule).

    The added token takes the next free id, which must be a row the target's embedding already has (Qwen3's
    embedding has 151936 rows for 151669 tokens, so ``<|MASK|>`` becomes 151669): vat never resizes the frozen target.

    Args:
        tokenizer: a transformers tokenizer (modified in place when a token is added).
        vocab_size: the target's embedding rows.

    Raises:
        VatError: the tokenizer has no free embedding row for the MASK token.
    """
    if getattr(tokenizer, "mask_token_id", None) is None:
        tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    mask = int(tokenizer.mask_token_id)
    if not 0 <= mask < vocab_size:
        raise VatError(
            f"the target tokenizer's MASK token gets id {mask} but the target's embedding has {vocab_size} rows: "
            "DFlash needs a MASK row in the frozen embedding (set drafter.mask_token_id to an unused id)"
        )
    return mask
