"""EAGLE-3 draft config: every field that defines a draft head and the target it was built for, and the check that a
draft fits a target (docs/vat_losses.md, §10). Split from :mod:`vat.drafters.eagle3`, which re-exports both names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vat.drafters.common import check_config_keys, draft_dims_for_target
from vat.errors import VatError
from vat.target.conventions import default_aux_layer_ids

NUM_AUX_LAYERS = 3
VH_INPUTS = ("normed", "prenorm")


# ----------------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Eagle3Config:
    """Everything that defines an EAGLE-3 draft head and the target it was built for.

    ``to_dict`` / ``from_dict`` round-trip through JSON; ``from_dict`` rejects unknown keys (naming the closest).
    ``head_dim`` and ``target_hidden_size`` left at ``None`` resolve in ``__post_init__``.
    """

    hidden_size: int = 4096  # draft hidden size H
    intermediate_size: int = 14336  # dense SwiGLU width of the draft MLP
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None  # None = hidden_size // num_attention_heads
    target_hidden_size: int | None = None  # H_t of the aux features; None = hidden_size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # default (unscaled) RoPE only
    max_position_embeddings: int = 4096  # written to serving configs; no effect on vat's forward
    vocab_size: int = 32000  # TARGET vocabulary (embedding rows, t2d length)
    draft_vocab_size: int = 32000  # lm_head rows, d2t length
    aux_layer_ids: list[int] | None = None  # vat convention: 0-indexed layer OUTPUTS; None = EAGLE-3 default
    num_target_layers: int | None = None  # the target's decoder layers (validation, default aux ids)
    norm_before_residual: bool = False  # residual from hidden_norm(g) instead of g (speculators / vLLM option)
    norm_before_fc: bool = False  # one RMSNorm over the 3*H_t concat before fc (speculators "gpt-oss style")
    fc_norm: bool = False  # one RMSNorm per aux chunk before fc ("EAGLE 3.1"); exclusive with norm_before_fc
    norm_output: bool = False  # speculators' meaning: norm(h), not h, feeds the next step (speculators' eagle3 default)
    sliding_window: int | None = None  # attention sees keys < this many positions back (speculators' default 2048)
    verification_head: bool = False  # Linear(H -> 1) + sigmoid at every step: P(this draft position is accepted)
    vh_input: str = "normed"  # the VH reads norm(h) (what lm_head reads) | "prenorm" h (checkpoints before it existed)
    ttt_steps: int = 7  # default TTT unroll K (also the speculative_tokens written to speculators configs)
    target_path: str | None = None  # the target this draft was trained for
    pad_token_id: int = 0  # token fed at teacher-forced positions past the end of a row

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
        if self.norm_before_fc and self.fc_norm:
            raise VatError(
                "norm_before_fc and fc_norm are mutually exclusive (one norm before fc, or one per aux layer)"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise VatError(f"draft_vocab_size ({self.draft_vocab_size}) must be in 1..vocab_size ({self.vocab_size})")
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
            if len(self.aux_layer_ids) != NUM_AUX_LAYERS:
                raise VatError(
                    f"EAGLE-3 takes exactly {NUM_AUX_LAYERS} aux layers, got aux_layer_ids={self.aux_layer_ids}"
                )
        if self.aux_layer_ids is None and self.num_target_layers is not None:
            self.aux_layer_ids = default_aux_layer_ids(self.num_target_layers)
        if self.sliding_window is not None and int(self.sliding_window) < 1:
            raise VatError(f"sliding_window must be >= 1 (or null for full attention), got {self.sliding_window}")
        if self.ttt_steps < 1:
            raise VatError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        if self.vh_input not in VH_INPUTS:
            raise VatError(f"vh_input must be one of {', '.join(VH_INPUTS)}, got {self.vh_input!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Eagle3Config:
        """Build from :meth:`to_dict` output; an unknown key raises :class:`VatError` naming the closest field."""
        check_config_keys(cls, data)
        if "vh_input" not in data:  # written before the key existed: the head read the pre-norm residual
            data = {**data, "vh_input": "prenorm"}
        return cls(**data)

    @classmethod
    def for_target(cls, target_config: Any, **overrides: Any) -> Eagle3Config:
        """A draft config sized from a transformers target config (dims, heads, RoPE, vocab, default aux ids).

        The shared dims (MLP width rule included) come from :func:`vat.drafters.common.draft_dims_for_target`.

        Args:
            target_config: the target's ``PretrainedConfig`` (text config for multimodal models).
            **overrides: any :class:`Eagle3Config` field, e.g. ``draft_vocab_size=32000``.
        """
        tc = getattr(target_config, "text_config", None) or target_config
        values: dict[str, Any] = dict(
            **draft_dims_for_target(tc),
            draft_vocab_size=min(32000, tc.vocab_size),
            pad_token_id=getattr(tc, "pad_token_id", None) or 0,
        )
        values.update(overrides)
        return cls(**values)


def check_draft_matches_target(
    cfg: Eagle3Config, target_hidden_size: int, target_vocab_size: int, num_target_layers: int
) -> list[int]:
    """Stop at once, with one clear line, when a draft was built for another target.

    Args:
        cfg: the draft's config.
        target_hidden_size: hidden size of the target about to feed it.
        target_vocab_size: the target's vocabulary size (embedding rows / logits width).
        num_target_layers: the target's number of decoder layers.

    Returns:
        The aux-layer ids to capture (vat convention), resolved to the EAGLE-3 default when the config has none.

    Raises:
        VatError: hidden size, vocabulary size or layer count differs, or an aux layer is out of range.
    """
    where = f" (draft trained for {cfg.target_path})" if cfg.target_path else ""
    if cfg.target_hidden_size != target_hidden_size:
        raise VatError(
            f"draft expects target hidden size {cfg.target_hidden_size}, this target has {target_hidden_size}{where}"
        )
    if cfg.vocab_size != target_vocab_size:
        raise VatError(f"draft expects target vocab size {cfg.vocab_size}, this target has {target_vocab_size}{where}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != num_target_layers:
        raise VatError(
            f"draft expects a target with {cfg.num_target_layers} layers, this target has {num_target_layers}{where}"
        )
    ids = cfg.aux_layer_ids if cfg.aux_layer_ids is not None else default_aux_layer_ids(num_target_layers)
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise VatError(
            f"draft aux layers {ids} (0-indexed layer outputs) out of range for a {num_target_layers}-layer target: {bad}"
        )
    return list(ids)
