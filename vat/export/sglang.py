"""SGLang (``LlamaForCausalLMEagle3``) export and import; also the EAGLE / SpecForge layout.

config.json: a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``,
``draft_vocab_size``, ``target_hidden_size`` (only when it differs from ``hidden_size``) and
``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's convention (= vat's numbers: layer outputs; SGLang adds
+1 internally to get its capture slot). Weights: ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``,
``d2t``, ``t2d``; no embedding (SGLang shares the target's). See ``docs/export.md``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from vat.errors import VatError
from vat.export.checkpoint import (
    CONFIG_FILE,
    VAT_FORMAT_VERSION,
    VH_FILE,
    WEIGHTS_FILE,
    _unwrap,
    draft_state,
    dtype_name,
    read_weights,
    warn_unsupported,
    write_json,
    write_safetensors,
)
from vat.target.conventions import (
    VAT_AUX_CONVENTION,
    VAT_AUX_CONVENTION_NOTE,
    sglang_to_vat_aux_ids,
    vat_to_sglang_aux_ids,
)

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"


# ----------------------------------------------------------------------------------------------------------------------
# Llama config pieces shared with the speculators layout
# ----------------------------------------------------------------------------------------------------------------------


def llama_config_dict(cfg: Eagle3Config, dtype: torch.dtype) -> dict[str, Any]:
    """The Llama-config part of an exported draft (one decoder layer; vocab_size = the TARGET vocabulary)."""
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": dtype_name(dtype),
    }


def parse_llama_config(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Eagle3Config fields from a Llama-style draft config; unsupported variants raise :class:`VatError`."""
    try:
        hidden = int(data["hidden_size"])
        heads = int(data["num_attention_heads"])
        values: dict[str, Any] = dict(
            hidden_size=hidden,
            intermediate_size=int(data["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or hidden // heads),
            vocab_size=int(data["vocab_size"]),
        )
    except KeyError as err:
        raise VatError(f"{source}: draft config lacks {err.args[0]!r}") from None
    rope_parameters = data.get("rope_parameters") or {}
    theta = data.get("rope_theta") or rope_parameters.get("rope_theta") or 10000.0
    scaling = data.get("rope_scaling") or rope_parameters
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type not in (None, "default"):
        raise VatError(
            f"{source}: RoPE scaling {rope_type!r} is not supported by vat's EAGLE-3 draft (default RoPE only)"
        )
    if int(data.get("num_hidden_layers", 1)) != 1:
        raise VatError(f"{source}: {data['num_hidden_layers']}-layer EAGLE-3 drafts are not supported (1 layer)")
    if data.get("hidden_act", "silu") != "silu":
        raise VatError(f"{source}: hidden_act {data['hidden_act']!r} is not supported (silu)")
    if data.get("attention_bias") or data.get("mlp_bias") or data.get("bias"):
        raise VatError(f"{source}: biased attention / MLP / fc are not supported")
    if data.get("tie_word_embeddings"):
        raise VatError(f"{source}: tie_word_embeddings=true (lm_head shared with the embedding) is not supported")
    values.update(
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(data.get("max_position_embeddings", 4096)),
        pad_token_id=int(data.get("pad_token_id") or 0),
    )
    return values


def vat_block(cfg: Eagle3Config, has_vh: bool) -> dict[str, Any]:
    """The ``vat`` block of an exported config: what the engine keys cannot express, with the labelled aux ids.
    Engines ignore it; :func:`apply_vat_block` reads it back."""
    return {
        "format_version": VAT_FORMAT_VERSION,
        "aux_layer_ids": cfg.aux_layer_ids,
        "aux_layer_convention": VAT_AUX_CONVENTION,
        "aux_layer_convention_note": VAT_AUX_CONVENTION_NOTE,
        "num_target_layers": cfg.num_target_layers,
        "target_path": cfg.target_path,
        "ttt_steps": cfg.ttt_steps,
        "verification_head_file": VH_FILE if has_vh else None,
        "vh_input": cfg.vh_input if has_vh else None,
    }


def apply_vat_block(values: dict[str, Any], block: dict[str, Any] | None, source: str) -> None:
    """Fill fields the engine keys left unset from a ``vat`` block; its aux ids must agree with the engine's."""
    if not block:
        return
    if block.get("aux_layer_convention", VAT_AUX_CONVENTION) != VAT_AUX_CONVENTION:
        raise VatError(f"{source}: vat block aux_layer_convention {block['aux_layer_convention']!r} unknown")
    ids = block.get("aux_layer_ids")
    engine_ids = values.get("aux_layer_ids")
    if ids is not None and engine_ids is not None and list(ids) != list(engine_ids):
        raise VatError(
            f"{source}: aux layers disagree: the engine key gives {engine_ids} (vat convention) but the vat block "
            f"says {list(ids)}; fix the config by hand"
        )
    if engine_ids is None and ids is not None:
        values["aux_layer_ids"] = list(ids)
    for key in ("num_target_layers", "target_path", "ttt_steps", "vh_input"):
        if block.get(key) is not None:
            values.setdefault(key, block[key])
    if block.get("verification_head_file") and block.get("vh_input") is None:
        values.setdefault("vh_input", "prenorm")  # exported before the key existed: the head read the residual


# ----------------------------------------------------------------------------------------------------------------------
# SGLang
# ----------------------------------------------------------------------------------------------------------------------


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
    data["norm_output"] = False  # the PRE-norm hidden feeds the next step
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
    model = _unwrap(model)
    cfg = model.config
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm"):
        if getattr(cfg, flag):
            warn_unsupported("sglang", f"{flag}=true is written to config.json but older SGLang builds ignore it")
    main, vh = draft_state(model)
    os.makedirs(output, exist_ok=True)
    write_safetensors(os.path.join(output, WEIGHTS_FILE), main)
    if vh:
        write_safetensors(os.path.join(output, VH_FILE), vh)
    write_json(os.path.join(output, CONFIG_FILE), sglang_config_dict(cfg, main["fc.weight"].dtype, bool(vh)))
    return output


def read_sglang(config: dict[str, Any], directory: str) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """Parse an SGLang / EAGLE / SpecForge draft config and its weights (vat names are applied by the caller)."""
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
    if config.get("norm_output"):
        raise VatError(f"{directory}: norm_output=true (post-norm recurrence) is not supported by vat's EAGLE-3 draft")
    apply_vat_block(values, config.get("vat"), directory)
    return Eagle3Config(**values), read_weights(directory)
