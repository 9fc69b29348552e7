"""``train.init_from``: start training from an existing EAGLE-3 draft (vat, SGLang or speculators layout), or a DFlash
draft (its release layout, :func:`init_dflash_from`).

The source fixes the architecture (dims, every norm flag, ``norm_output``, ``sliding_window``) and the draft vocabulary
(its d2t / t2d; none = the full target vocabulary); the recipe decides what training adds: the TTT unroll and whether
a verification head is trained (freshly initialised when the source has none; dropped when the recipe trains none).
Every mismatch with the target stops with one line naming both values.
"""

from __future__ import annotations

import dataclasses

import torch

from vat.drafters.dflash import DFlashConfig, DFlashDrafter, check_dflash_matches_target
from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from vat.errors import VatError
from vat.export.checkpoint import load_draft, read_draft_config
from vat.target.conventions import default_aux_layer_ids

VH_PREFIX = "verification_head."


def source_aux_layer_ids(directory: str) -> list[int] | None:
    """The aux layers (vat convention) a draft directory was trained on; None = the EAGLE-3 default."""
    return read_draft_config(directory).aux_layer_ids


def check_source_fits_target(
    cfg: Eagle3Config,
    where: str,
    *,
    target_hidden_size: int,
    target_vocab_size: int,
    num_target_layers: int,
    aux_layer_ids: list[int],
    embed_width: int,
) -> list[int]:
    """Stop with one line ``init_from DIR: draft X ≠ target Y`` unless the source draft fits the target.

    Returns:
        The source's aux-layer ids (vat convention), resolved to the EAGLE-3 default when the source names none.
    """
    if cfg.target_hidden_size != target_hidden_size:
        raise VatError(
            f"{where}: draft target_hidden_size {cfg.target_hidden_size} ≠ target hidden_size {target_hidden_size}"
        )
    if cfg.vocab_size != target_vocab_size:
        raise VatError(f"{where}: draft vocab_size {cfg.vocab_size} ≠ target vocab_size {target_vocab_size}")
    if cfg.hidden_size != embed_width:
        raise VatError(
            f"{where}: draft hidden_size {cfg.hidden_size} ≠ target embedding width {embed_width} (the "
            "draft reads the target's embedding)"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != num_target_layers:
        raise VatError(f"{where}: draft num_target_layers {cfg.num_target_layers} ≠ target layers {num_target_layers}")
    ids = list(cfg.aux_layer_ids) if cfg.aux_layer_ids is not None else default_aux_layer_ids(num_target_layers)
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise VatError(
            f"{where}: draft aux layers {ids} (0-indexed layer outputs) out of range for a "
            f"{num_target_layers}-layer target: {bad}"
        )
    if ids != list(aux_layer_ids):
        raise VatError(
            f"{where}: draft aux layers {ids} ≠ the target's captured layers {list(aux_layer_ids)} "
            "(leave target.aux_layer_ids unset to capture the draft's)"
        )
    return ids


def init_draft_from(
    directory: str,
    *,
    target_hidden_size: int,
    target_vocab_size: int,
    num_target_layers: int,
    aux_layer_ids: list[int],
    embed_weight: torch.Tensor,
    verification_head: bool,
    vh_input: str = "normed",
    ttt_steps: int | None = None,
    target_path: str | None = None,
) -> Eagle3Drafter:
    """Load a draft to continue training it on this target (fp32 weights, train mode, embedding attached).

    Args:
        directory: the source draft (any layout :func:`vat.export.load_draft` reads).
        target_hidden_size: the target's hidden size (aux features are 3x this wide).
        target_vocab_size: the target's vocabulary size.
        num_target_layers: the target's decoder layers.
        aux_layer_ids: the layers the target captures (vat convention); must be the source's.
        embed_weight: (V, H) the target's input embedding (shared, frozen).
        verification_head: train a verification head (kept from the source when it has one, else fresh: zero weight
            and the prior bias); False drops a source head.
        vh_input: what a fresh head reads (a kept head keeps the source's).
        ttt_steps: the recipe's TTT unroll; None = the source's.
        target_path: recorded as the draft's target; None = keep the source's.

    Returns:
        The draft; its body weights are exactly the source's.

    Raises:
        VatError: the source cannot be read or does not fit the target (one line naming the mismatch).
    """
    where = f"init_from {directory}"
    cfg = read_draft_config(directory)
    if not isinstance(cfg, Eagle3Config):
        raise VatError(f"{where} is a {type(cfg).__name__.removesuffix('Config')} draft: set drafter.kind=dflash")
    ids = check_source_fits_target(
        cfg,
        where,
        target_hidden_size=target_hidden_size,
        target_vocab_size=target_vocab_size,
        num_target_layers=num_target_layers,
        aux_layer_ids=aux_layer_ids,
        embed_width=int(embed_weight.shape[-1]),
    )
    try:
        source, cfg = load_draft(directory, embed_weight=embed_weight, dtype=torch.float32)
    except VatError as err:  # name the recipe key, not only the directory
        message = str(err).removeprefix(f"{directory}: ")
        raise VatError(f"{where}: {message}") from None
    keep_head = verification_head and source.verification_head is not None
    new_cfg = dataclasses.replace(
        cfg,
        aux_layer_ids=ids,
        num_target_layers=num_target_layers,
        verification_head=verification_head,
        vh_input=cfg.vh_input if keep_head else vh_input,
        ttt_steps=ttt_steps or cfg.ttt_steps,
        target_path=target_path or cfg.target_path,
    )
    model = Eagle3Drafter(new_cfg, embed_weight=embed_weight)  # a fresh head starts at the prior
    state = {k: v for k, v in source.state_dict().items() if keep_head or not k.startswith(VH_PREFIX)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith(VH_PREFIX) for k in missing):
        raise VatError(f"{where}: weights do not fit (missing {missing}, unexpected {unexpected})")
    return model.train()


def init_dflash_from(
    directory: str,
    *,
    target_hidden_size: int,
    target_vocab_size: int,
    num_target_layers: int,
    target_layer_ids: list[int],
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    verification_head: bool,
    block_size: int | None = None,
    target_path: str | None = None,
):
    """Load a DFlash draft to continue training it on this target (fp32, train mode, target tables attached).

    The source fixes the architecture, the context layers and the MASK token; the recipe decides the block size it
    trains at and whether a verification head is trained (kept from the source when it has one, else fresh).

    Args:
        directory: the source draft (DFlash release layout, which is also vat's DFlash checkpoint).
        target_hidden_size: the target's hidden size.
        target_vocab_size: the target's vocabulary size.
        num_target_layers: the target's decoder layers.
        target_layer_ids: the layers the target captures (vat convention); must be the source's.
        embed_weight: (V, H) the target's input embedding.
        lm_head_weight: (V, H) the target's LM head.
        verification_head: train a verification head.
        block_size: the recipe's block size; None = the source's.
        target_path: recorded as the draft's target; None = keep the source's.

    Raises:
        VatError: the source cannot be read, is not a DFlash draft, or does not fit the target.
    """
    where = f"init_from {directory}"
    cfg = read_draft_config(directory)
    if not isinstance(cfg, DFlashConfig):
        raise VatError(f"{where} is an EAGLE-3 draft but drafter.kind is dflash")
    try:
        ids = check_dflash_matches_target(cfg, target_hidden_size, target_vocab_size, num_target_layers)
    except VatError as err:
        raise VatError(f"{where}: {err}") from None
    if ids != list(target_layer_ids):
        raise VatError(f"{where}: draft target layers {ids} ≠ the target's captured layers {list(target_layer_ids)} "
                       "(leave target.aux_layer_ids unset to capture the draft's)")
    source, cfg = load_draft(directory, dtype=torch.float32)
    keep_head = verification_head and source.verification_head is not None
    new_cfg = dataclasses.replace(
        cfg, num_target_layers=num_target_layers, verification_head=verification_head,
        block_size=block_size or cfg.block_size, target_path=target_path or cfg.target_path,
    )
    model = DFlashDrafter(new_cfg, embed_weight, lm_head_weight)  # a fresh head starts at the prior
    state = {k: v for k, v in source.state_dict().items() if keep_head or not k.startswith(VH_PREFIX)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith(VH_PREFIX) for k in missing):
        raise VatError(f"{where}: weights do not fit (missing {missing}, unexpected {unexpected})")
    return model.train()
