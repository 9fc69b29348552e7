"""DFlash drafts on disk: the public DFlash release layout (z-lab ``DFlashDraftModel``), which is also what the trainer
writes for a DFlash draft, so a vat checkpoint loads in DFlash's own code, SGLang and vLLM as it is.

config.json: a Qwen3 config (``architectures: ["DFlashDraftModel"]``, ``model_type: qwen3``) with the draft's layer
count in ``num_hidden_layers``, ``block_size`` and ``num_target_layers`` at the top level, and
``dflash_config: {target_layer_ids, mask_token_id, block_size}`` (DFlash's loader reads ``dflash_config`` first);
the target layer ids are 0-indexed layer outputs, DFlash's convention and vat's alike. A ``vat`` block records
what the release keys cannot (the target path, the verification head file). Weights (``model.safetensors``): ``fc``,
``hidden_norm``, ``layers.{i}.*``, ``norm``; no embedding and no LM head (the target's are used).
``verification_head.safetensors`` holds the VAT head when the draft has one (DFlash loaders ignore the file).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from vat.drafters.dflash import DFlashConfig, DFlashDrafter
from vat.errors import VatError
from vat.export.checkpoint import (
    CONFIG_FILE,
    VH_FILE,
    DraftFormat,
    add_verification_head,
    draft_state,
    dtype_name,
    llama_layer_dims,
    load_strict,
    read_json,
    read_weights,
    register_format,
    register_writer,
    write_draft_files,
)
from vat.target.conventions import VAT_AUX_CONVENTION

DFLASH_ARCHITECTURE = "DFlashDraftModel"
VAT_DFLASH_FORMAT_VERSION = 1
# config keys of DFlash variants vat's drafter does not compute: refusing them beats loading a different model
UNSUPPORTED_DFLASH_KEYS = ("output_multiplier", "final_logit_softcapping", "selector_rank", "conv_kernel_size")


def dflash_config_dict(cfg: DFlashConfig, dtype: torch.dtype, has_vh: bool = False) -> dict[str, Any]:
    """The release ``config.json`` of a DFlash draft (plus the ``vat`` block)."""
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
        },
        "torch_dtype": dtype_name(dtype),
        "vat": {
            "format_version": VAT_DFLASH_FORMAT_VERSION,
            "target_layer_convention": VAT_AUX_CONVENTION,
            "target_hidden_size": cfg.target_hidden_size,
            "target_path": cfg.target_path,
            "verification_head_file": VH_FILE if has_vh else None,
        },
    }


def is_dflash_config(config: dict[str, Any]) -> bool:
    """True for a DFlash release config; a DFlash2 (or other variant) config is refused in one line."""
    archs = config.get("architectures") or []
    if DFLASH_ARCHITECTURE in archs:
        return True
    variants = [a for a in archs if "DFlash" in a]
    if variants:
        raise VatError(f"{variants[0]} drafts are not supported (vat's DFlash drafter is {DFLASH_ARCHITECTURE})")
    return False


def parse_dflash_config(config: dict[str, Any], directory: str) -> DFlashConfig:
    """A release ``config.json`` -> :class:`DFlashConfig`; variants vat does not compute raise :class:`VatError`."""
    inner = config.get("dflash_config") or {}

    def value(key: str, default: Any = None) -> Any:  # DFlash's loader: dflash_config first, then the top level
        return inner.get(key, config.get(key, default))

    for key in UNSUPPORTED_DFLASH_KEYS:
        if value(key) is not None:
            raise VatError(f"{directory}: DFlash config key {key!r} is not supported by vat's DFlash drafter")
    if float(value("input_embedding_scale", 1.0)) != 1.0:
        raise VatError(f"{directory}: input_embedding_scale != 1 is not supported")
    layer_types = config.get("layer_types") or []
    if config.get("is_causal") or any(t != "full_attention" for t in layer_types):
        raise VatError(f"{directory}: causal or sliding-window DFlash layers are not supported (full attention only)")
    if config.get("hidden_act", "silu") != "silu":
        raise VatError(f"{directory}: hidden_act {config['hidden_act']!r} is not supported (silu)")
    if config.get("attention_bias") or config.get("tie_word_embeddings"):
        raise VatError(f"{directory}: attention biases / tied embeddings are not supported")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in (None, "default"):
        raise VatError(f"{directory}: RoPE scaling {rope.get('rope_type') or rope.get('type')!r} is not supported")
    ids = value("target_layer_ids")
    if ids is None:
        raise VatError(f"{directory}: DFlash config has no target_layer_ids")
    if value("mask_token_id") is None:
        raise VatError(f"{directory}: DFlash config has no mask_token_id")
    block = config.get("vat") or {}
    try:
        dims = llama_layer_dims(config)
        return DFlashConfig(
            **dims,
            num_hidden_layers=int(config["num_hidden_layers"]),
            target_hidden_size=int(block.get("target_hidden_size") or dims["hidden_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            vocab_size=int(config["vocab_size"]),
            target_layer_ids=[int(i) for i in ids],
            num_target_layers=config.get("num_target_layers"),
            block_size=int(value("block_size", 16)),
            mask_token_id=int(value("mask_token_id")),
            verification_head=bool(block.get("verification_head_file")),
            target_path=block.get("target_path"),
        )
    except KeyError as err:
        raise VatError(f"{directory}: DFlash config lacks {err.args[0]!r}") from None


def save_dflash(model: DFlashDrafter, directory: str) -> str:
    """Write ``model`` in the DFlash release layout (config.json, model.safetensors, verification_head.safetensors).

    Args:
        model: the draft (unwrapped).
        directory: created if missing; our files in it are replaced.

    Returns:
        ``directory``.
    """
    main, vh = draft_state(model)  # never the target's embedding or LM head: neither is in state_dict()
    config = dflash_config_dict(model.config, main["fc.weight"].dtype, bool(vh))
    return write_draft_files(directory, main, vh, config, remove_stale_vh=True)


def load_dflash(
    directory: str,
    embed_weight: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[DFlashDrafter, DFlashConfig]:
    """Load a DFlash draft (the release layout; :func:`vat.export.load_draft` dispatches here).

    Returns:
        ``(model, cfg)`` in eval mode; attach the target's tables with ``set_embedding`` (done here when
        ``embed_weight`` is given) and ``set_lm_head``.
    """
    cfg = parse_dflash_config(read_json(os.path.join(directory, CONFIG_FILE)), directory)
    state = {}
    for name, tensor in read_weights(directory).items():
        name = name[len("model.") :] if name.startswith("model.") else name
        if name.startswith(("embed_tokens.", "lm_head.", "rotary_emb.")):
            continue  # the target's tables (some exports ship them) and RoPE buffers are not the draft's weights
        state[name] = tensor
    add_verification_head(state, cfg, directory)
    model = DFlashDrafter(cfg)
    load_strict(model, state, directory)
    model.to(device=device or "cpu", dtype=dtype or state["fc.weight"].dtype)
    if embed_weight is not None:
        model.set_embedding(embed_weight)
    return model.eval(), cfg


def export_dflash(model: Any, output: str) -> str:
    """``vat export --format dflash``: write a DFlash draft in the release layout (the layout it is kept in)."""
    if not isinstance(model, DFlashDrafter):
        raise VatError(f"--format dflash needs a DFlash draft; this is an {type(model).__name__} (use sglang or "
                       "speculators for EAGLE-3 drafts)")
    return save_dflash(model, output)


register_format(DraftFormat("dflash", 0, is_dflash_config, parse_dflash_config, load=load_dflash))
register_writer(DFlashDrafter, save_dflash)
