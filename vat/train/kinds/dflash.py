"""The DFlash block drafter as the trainer builds it: the target's vocabulary, embedding and LM head, and one block
per sampled anchor (:func:`vat.drafters.dflash.sample_block_anchors`, :func:`vat.slots.block_slots`)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoTokenizer

from vat.drafters.dflash import DFlashConfig, DFlashDrafter, check_dflash_matches_target, sample_block_anchors
from vat.drafters.dflash_config import default_target_layer_ids, resolve_mask_token_id
from vat.errors import VatError
from vat.export.init_from import init_dflash_from
from vat.slots import block_slots
from vat.train.kinds.base import DrafterKind

# recipe keys that size a fresh drafter when set (None: the target's own); its hidden size is always the target's
SIZE_KEYS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "rope_theta")


class DFlashKind(DrafterKind):
    name, title, full_vocab, supports_lora, schedule = "dflash", "DFlash", True, False, "dflash"

    def new(self, cfg: Any, target: Any, vocab_path: str | None) -> torch.nn.Module:
        if cfg.target.aux_layer_ids is None:  # DFlash's context layers (from 1 to L-3), not EAGLE-3's three
            target.aux_layer_ids = default_target_layer_ids(target.num_layers, cfg.drafter.num_layers)
        mask = cfg.drafter.mask_token_id
        if mask is None and target.path:
            mask = resolve_mask_token_id(AutoTokenizer.from_pretrained(target.path), target.vocab_size)
        if mask is None:
            raise VatError("the target has no tokenizer to take the DFlash MASK token from: set drafter.mask_token_id")
        overrides: dict[str, Any] = dict(
            num_hidden_layers=cfg.drafter.num_layers, target_layer_ids=list(target.aux_layer_ids),
            block_size=cfg.drafter.block_size, mask_token_id=int(mask),
            verification_head=bool(cfg.drafter.verification_head), target_path=target.path or str(cfg.target.path),
            vocab_size=target.vocab_size,
        )
        if cfg.drafter.hidden_size not in (None, target.hidden_size):
            raise VatError(f"drafter.hidden_size {cfg.drafter.hidden_size}: a DFlash draft reads the target's "
                           f"embedding and LM head, so its hidden size is the target's ({target.hidden_size})")
        overrides.update({key: cfg.drafter[key] for key in SIZE_KEYS if cfg.drafter[key] is not None})
        if cfg.drafter.num_attention_heads is not None:
            overrides["head_dim"] = target.hidden_size // cfg.drafter.num_attention_heads
        draft_config = DFlashConfig.for_target(target.config, **overrides)
        self.check(draft_config, target)
        torch.manual_seed(cfg.seed)
        return DFlashDrafter(draft_config, target.embed_tokens().weight.detach(), target.lm_head().weight.detach())

    def import_from(self, cfg: Any, target: Any) -> tuple[torch.nn.Module, str]:
        drafter = init_dflash_from(
            cfg.train.init_from, target_hidden_size=target.hidden_size, target_vocab_size=target.vocab_size,
            num_target_layers=target.num_layers, target_layer_ids=list(target.aux_layer_ids),
            embed_weight=target.embed_tokens().weight.detach(), lm_head_weight=target.lm_head().weight.detach(),
            verification_head=bool(cfg.drafter.verification_head), block_size=cfg.drafter.block_size,
            target_path=target.path or str(cfg.target.path),
        )
        c = drafter.config
        return drafter, (f"DFlash, {c.num_hidden_layers} layers, target layers {c.target_layer_ids}, mask token "
                         f"{c.mask_token_id}")

    def check(self, draft_config: Any, target: Any) -> None:
        check_dflash_matches_target(draft_config, target.hidden_size, target.vocab_size, target.num_layers)

    def num_slots(self, cfg: Any, draft_config: Any) -> int:
        return int(draft_config.num_slots)

    def training_slots(self, drafter: Any, draft_config: Any, cfg: Any, batch: dict[str, torch.Tensor], tout: Any,
                       dist: Any, num_experts: int, anchor_seed: int, autocast: Any) -> Any:
        gen = torch.Generator().manual_seed(anchor_seed)
        # from the CPU copies of the masks (no device-to-host sync), then onto the batch's device
        anchors = sample_block_anchors(batch.get("host_loss_mask", batch["loss_mask"]),
                                       batch.get("host_attention_mask", batch["attention_mask"]),
                                       draft_config.block_size, cfg.drafter.num_anchors,
                                       gen).to(batch["input_ids"].device)  # (B, N)
        with autocast():
            out = drafter(tout.aux_hidden, batch["input_ids"], anchors, batch["attention_mask"],
                          vh_detach=cfg.loss.vh_detach, attention=cfg.drafter.attention,
                          head_logits=cfg.loss.imitation_chunk_mb)
        return block_slots(out, dist, batch, tout.topk_ids, num_experts, anchors, bool(cfg.loss.onpolicy_chain))
