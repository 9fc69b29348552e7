"""vLLM speculators layout (``speculators_model_type: eagle3``): export and import.

``vllm serve DIR`` auto-detects it. The aux ids are written in vLLM's convention (vat id + 1) under the top-level
``eagle_aux_hidden_state_layer_ids``; ``norm_before_residual`` is always explicit (vLLM defaults it to True when
absent). Weights use speculators' names: ``fc.weight``, ``layers.0.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``,
``t2d`` (plus ``input_norm.weight`` / ``fc_norm.{i}.weight`` when enabled). See ``docs/export.md``.
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
from vat.export.sglang import apply_vat_block, llama_config_dict, parse_llama_config, vat_block
from vat.target.conventions import vat_to_vllm_aux_ids, vllm_to_vat_aux_ids

SPECULATORS_ARCHITECTURE = "Eagle3Speculator"


def verifier_architectures(target_path: str | None) -> list[str]:
    """The target's ``architectures`` from ``TARGET/config.json`` when it is a local directory, else ``[]``."""
    if target_path and os.path.isfile(os.path.join(target_path, "config.json")):
        try:
            with open(os.path.join(target_path, "config.json")) as f:
                return list(json.load(f).get("architectures") or [])
        except (OSError, json.JSONDecodeError):
            return []
    return []


def speculators_config_dict(
    cfg: Eagle3Config, dtype: torch.dtype, has_vh: bool = False, architectures: list[str] | None = None
) -> dict[str, Any]:
    """The speculators ``config.json`` for ``cfg``.

    Args:
        cfg: the draft config.
        dtype: weight dtype (``torch_dtype``).
        has_vh: a verification-head side file is written.
        architectures: the verifier's architectures; None = read from ``cfg.target_path`` when local.
    """
    if architectures is None:
        architectures = verifier_architectures(cfg.target_path)
    data: dict[str, Any] = {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": False,  # speculators' meaning: feed the post-norm hidden to the next step; vat feeds pre-norm
        "embed_requires_grad": False,
    }
    if cfg.aux_layer_ids is not None:
        data["eagle_aux_hidden_state_layer_ids"] = vat_to_vllm_aux_ids(cfg.aux_layer_ids)
    data["speculators_config"] = {
        "algorithm": "eagle3",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": cfg.ttt_steps,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": cfg.target_path, "architectures": architectures},
    }
    data["transformer_layer_config"] = llama_config_dict(cfg, dtype)
    data["torch_dtype"] = dtype_name(dtype)
    data["vat"] = vat_block(cfg, has_vh)
    return data


def to_speculators_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vat / SGLang weight names -> speculators' (``midlayer.`` -> ``layers.0.``)."""
    return {("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in state.items()}


def export_speculators(model: Eagle3Drafter, output: str, architectures: list[str] | None = None) -> str:
    """Write ``model`` in the speculators layout (``vllm serve OUTPUT`` detects it).

    Args:
        model: the draft (wrappers are unwrapped).
        output: directory, created if missing; our files in it are replaced.
        architectures: the verifier's architectures; None = read from the target's local config.json.

    Returns:
        ``output``.
    """
    model = _unwrap(model)
    cfg = model.config
    for flag in ("norm_before_fc", "fc_norm"):
        if getattr(cfg, flag):
            warn_unsupported("speculators", f"{flag}=true is written to config.json but older vLLM builds ignore it")
    main, vh = draft_state(model)
    os.makedirs(output, exist_ok=True)
    write_safetensors(os.path.join(output, WEIGHTS_FILE), to_speculators_names(main))
    if vh:
        write_safetensors(os.path.join(output, VH_FILE), vh)
    data = speculators_config_dict(cfg, main["fc.weight"].dtype, bool(vh), architectures)
    write_json(os.path.join(output, CONFIG_FILE), data)
    return output


def read_speculators(config: dict[str, Any], directory: str) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """Parse a speculators EAGLE-3 config and its weights (vat names are applied by the caller)."""
    layer_config = config.get("transformer_layer_config")
    if not isinstance(layer_config, dict):
        raise VatError(f"{directory}: speculators config lacks transformer_layer_config")
    values = parse_llama_config(layer_config, directory)
    values["draft_vocab_size"] = int(config.get("draft_vocab_size") or 32000)  # speculators' default
    values["target_hidden_size"] = int(config.get("target_hidden_size") or values["hidden_size"])
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    values["aux_layer_ids"] = vllm_to_vat_aux_ids(ids) if ids else None
    values["norm_before_residual"] = bool(config.get("norm_before_residual", True))  # vLLM's loader default
    values["norm_before_fc"] = bool(config.get("norm_before_fc", False))
    values["fc_norm"] = bool(config.get("fc_norm", False))
    if config.get("norm_output"):
        raise VatError(f"{directory}: norm_output=true (post-norm recurrence) is not supported by vat's EAGLE-3 draft")
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or []
    if methods and methods[0].get("speculative_tokens"):
        values["ttt_steps"] = int(methods[0]["speculative_tokens"])
    verifier = spec.get("verifier") or {}
    if verifier.get("name_or_path"):
        values["target_path"] = verifier["name_or_path"]
    apply_vat_block(values, config.get("vat"), directory)
    return Eagle3Config(**values), read_weights(directory)
