"""The EAGLE-3 head as the trainer builds it: a draft vocabulary, the training-time-test unroll of ``ttt_steps``
steps from every position (:func:`vat.slots.ttt_slots`)."""

from __future__ import annotations

from typing import Any

import torch

from vat.data_prep.vocab import load_draft_vocab
from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter, check_draft_matches_target
from vat.export.init_from import init_draft_from
from vat.slots import ttt_slots
from vat.train.kinds.base import DrafterKind

# recipe keys that size a fresh head when set (None: the target's own)
SIZE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rope_theta")


class Eagle3Kind(DrafterKind):
    name, title, full_vocab, supports_lora, schedule = "eagle3", "EAGLE-3", False, True, "eagle3"

    def new(self, cfg: Any, target: Any, vocab_path: str | None) -> torch.nn.Module:
        d2t, t2d = load_draft_vocab(vocab_path)
        overrides: dict[str, Any] = dict(
            draft_vocab_size=int(d2t.shape[0]), aux_layer_ids=list(target.aux_layer_ids),
            ttt_steps=cfg.drafter.ttt_steps, norm_before_residual=cfg.drafter.norm_before_residual,
            norm_before_fc=cfg.drafter.norm_before_fc, fc_norm=cfg.drafter.fc_norm,
            verification_head=bool(cfg.drafter.verification_head), vh_input=cfg.drafter.vh_input,
            target_path=target.path or str(cfg.target.path), vocab_size=target.vocab_size,
        )
        overrides.update({key: cfg.drafter[key] for key in SIZE_KEYS if cfg.drafter[key] is not None})
        if cfg.drafter.hidden_size is not None and cfg.drafter.num_attention_heads is not None:
            overrides["head_dim"] = cfg.drafter.hidden_size // cfg.drafter.num_attention_heads
        draft_config = Eagle3Config.for_target(target.config, **overrides)
        self.check(draft_config, target)
        torch.manual_seed(cfg.seed)
        drafter = Eagle3Drafter(draft_config, embed_weight=target.embed_tokens().weight.detach())
        drafter.set_vocab_mapping(d2t, t2d)
        return drafter

    def import_from(self, cfg: Any, target: Any) -> tuple[torch.nn.Module, str]:
        drafter = init_draft_from(
            cfg.train.init_from, target_hidden_size=target.hidden_size, target_vocab_size=target.vocab_size,
            num_target_layers=target.num_layers, aux_layer_ids=list(target.aux_layer_ids),
            embed_weight=target.embed_tokens().weight.detach(), verification_head=bool(cfg.drafter.verification_head),
            vh_input=cfg.drafter.vh_input, ttt_steps=cfg.drafter.ttt_steps,
            target_path=target.path or str(cfg.target.path),
        )
        c = drafter.config
        return drafter, (f"hidden {c.hidden_size}, draft vocab {c.draft_vocab_size}, norm_before_residual="
                         f"{c.norm_before_residual} norm_before_fc={c.norm_before_fc} fc_norm={c.fc_norm} "
                         f"norm_output={c.norm_output} sliding_window={c.sliding_window}")

    def check(self, draft_config: Any, target: Any) -> None:
        check_draft_matches_target(draft_config, target.hidden_size, target.vocab_size, target.num_layers)

    def num_slots(self, cfg: Any, draft_config: Any) -> int:
        return int(cfg.drafter.ttt_steps)

    def training_slots(self, drafter: Any, draft_config: Any, cfg: Any, batch: dict[str, torch.Tensor], tout: Any,
                       dist: Any, num_experts: int, anchor_seed: int, autocast: Any) -> Any:
        num_slots = self.num_slots(cfg, draft_config)
        with autocast():
            out = drafter(tout.aux_hidden, batch["input_ids"], batch["attention_mask"], ttt_steps=num_slots,
                          vh_detach=cfg.loss.vh_detach, attention=cfg.drafter.attention)
        return ttt_slots(out, dist, batch, tout.topk_ids, num_experts, num_slots, bool(cfg.loss.onpolicy_chain))
