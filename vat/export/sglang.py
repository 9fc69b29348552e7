"""SGLang (``LlamaForCausalLMEagle3``) export and import; also the EAGLE / SpecForge layout.

config.json: a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``,
``draft_vocab_size``, ``target_hidden_size`` (only when it differs from ``hidden_size``) and
``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's convention (= vat's numbers: layer outputs; SGLang adds
+1 internally to get its capture slot). Weights: ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``,
``d2t``, ``t2d``; no embedding: SGLang's EAGLE-3 worker always replaces the draft's with the target's
(``set_embed``), and SpecForge drops it from its checkpoints. See ``docs/export.md``.

``norm_output`` in this layout: SGLang's draft always feeds the pre-norm hidden to the next step (its final norm
returns the residual sum as the aux state) and SpecForge uses the key for "norm before lm_head"; so a foreign config's
top-level ``norm_output`` means nothing to the recurrence. vat's own exports carry the draft's real value in the
``vat`` block, which is what vat reads back.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from vat.export.checkpoint import (
    DraftFormat,
    apply_vat_block,
    draft_state,
    llama_config_dict,
    parse_llama_config,
    register_format,
    unwrap_draft,
    vat_block,
    warn_flags_older_engines_ignore,
    warn_unsupported,
    write_draft_files,
)
from vat.target.conventions import sglang_to_vat_aux_ids, vat_to_sglang_aux_ids

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"


def sglang_config_dict(cfg: Eagle3Config, dtype: torch.dtype, has_vh: bool = False) -> dict[str, Any]:
    """The SGLang draft ``config.json`` for ``cfg``."""
    data: dict[str, Any] = {"architectures": [SGLANG_ARCHITECTURE]}
    data.update(llama_config_dict(cfg, dtype))
    data["draft_vocab_size"] = cfg.draft_vocab_size
    if cfg.target_hidden_size != cfg.hidden_size:
        data["target_hidden_size"] = cfg.target_hidden_size
    data["norm_before_residual"] = cfg.norm_before_residual
    data["norm_before_fc"] = cfg.norm_before_fc
    data["fc_norm"] = cfg.fc_norm
    data["norm_output"] = cfg.norm_output  # speculators' meaning; SGLang ignores it (module docstring)
    eagle_config: dict[str, Any] = {"use_aux_hidden_state": True}
    if cfg.aux_layer_ids is not None:
        eagle_config["eagle_aux_hidden_state_layer_ids"] = vat_to_sglang_aux_ids(cfg.aux_layer_ids)
    data["eagle_config"] = eagle_config
    data["vat"] = vat_block(cfg, has_vh)
    return data


def export_sglang(model: Eagle3Drafter, output: str) -> str:
    """Write ``model`` as an SGLang EAGLE-3 draft directory (``--speculative-draft-model-path OUTPUT``).

    Args:
        model: the draft (wrappers are unwrapped).
        output: directory, created if missing; our files in it are replaced.

    Returns:
        ``output``.
    """
    model = unwrap_draft(model)
    cfg = model.config
    warn_flags_older_engines_ignore("sglang", cfg, ("norm_before_residual", "norm_before_fc", "fc_norm"), "SGLang")
    if cfg.norm_output:
        warn_unsupported("sglang", "norm_output=true: SGLang feeds the pre-norm hidden to the next draft step")
    if cfg.sliding_window is not None:
        warn_unsupported("sglang", f"sliding_window={cfg.sliding_window}: SGLang's Llama draft attends every position")
    main, vh = draft_state(model)
    config = sglang_config_dict(cfg, main["fc.weight"].dtype, bool(vh))
    return write_draft_files(output, main, vh, config, remove_stale_vh=False)


def parse_sglang_config(config: dict[str, Any], directory: str) -> Eagle3Config:
    """An SGLang / EAGLE / SpecForge draft config -> :class:`Eagle3Config` (engine defaults for absent keys)."""
    values = parse_llama_config(config, directory)
    values["draft_vocab_size"] = int(config.get("draft_vocab_size") or values["vocab_size"])
    values["target_hidden_size"] = int(config.get("target_hidden_size") or values["hidden_size"])
    eagle_config = config.get("eagle_config") or {}
    if isinstance(eagle_config, str):
        eagle_config = json.loads(eagle_config)
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    values["aux_layer_ids"] = sglang_to_vat_aux_ids(ids) if ids else None
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm"):
        values[flag] = bool(config.get(flag, eagle_config.get(flag, False)))
    apply_vat_block(values, config.get("vat"), directory)  # norm_output only from here (module docstring)
    return Eagle3Config(**values)


def is_sglang_config(config: dict[str, Any]) -> bool:
    """``LlamaForCausalLMEagle3`` (or any ``*Eagle3*`` architecture), or the official EAGLE layout
    (``["LlamaForCausalLM"]`` with ``draft_vocab_size``)."""
    archs = config.get("architectures") or []
    return any("Eagle3" in a for a in archs) or (archs == ["LlamaForCausalLM"] and "draft_vocab_size" in config)


register_format(DraftFormat("sglang", 2, is_sglang_config, parse_sglang_config))
