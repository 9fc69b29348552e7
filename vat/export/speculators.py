"""vLLM speculators layout (``speculators_model_type: eagle3``): export and import.

``vllm serve DIR`` auto-detects it and speculators' ``Eagle3DraftModel.from_pretrained`` loads it. The aux ids are
written in vLLM's convention (vat id + 1) under the top-level ``eagle_aux_hidden_state_layer_ids``;
``norm_before_residual`` is always explicit (vLLM defaults it to True when absent). Weights use speculators' names:
``embed_tokens.weight`` (the target's table: speculators zero-fills it when missing), ``fc.weight``, ``layers.0.*``,
``norm.weight``, ``lm_head.weight``, ``d2t`` / ``t2d`` (only for a reduced draft vocab, as speculators writes them),
plus ``input_norm.weight`` / ``fc_norm.{i}.weight`` when enabled. Flags mean what speculators' model computes:
``norm_output`` feeds ``norm(h)`` to the next step; ``transformer_layer_config.layer_types == ["sliding_attention"]``
applies ``sliding_window``. See ``docs/export.md``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from vat.errors import VatError
from vat.export.checkpoint import (
    EMBED_KEY,
    DraftFormat,
    apply_vat_block,
    draft_state,
    dtype_name,
    llama_config_dict,
    parse_llama_config,
    register_format,
    unwrap_draft,
    vat_block,
    warn_flags_older_engines_ignore,
    write_draft_files,
)
from vat.export.target_embedding import read_target_embedding
from vat.target.conventions import vat_to_vllm_aux_ids, vllm_to_vat_aux_ids

SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_DRAFT_VOCAB_DEFAULT = 32000  # Eagle3SpeculatorConfig.draft_vocab_size


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
        "norm_output": cfg.norm_output,  # speculators' meaning: norm(h) feeds the next step
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


def export_embedding(model: Eagle3Drafter, target: str | None = None) -> torch.Tensor:
    """(V, H) the table to ship as ``embed_tokens.weight``: the draft's attached one, else read from ``target`` (or the
    draft's ``target_path``).

    Raises:
        VatError: neither is available (an export without it would load with a zero embedding in speculators).
    """
    if model.embed_tokens is not None:
        return model.embed_tokens.weight
    path = target or model.config.target_path
    if not path:
        raise VatError(
            "speculators export needs the target's input embedding (speculators zero-fills a missing "
            "embed_tokens.weight): attach it (model.set_embedding) or name the target"
        )
    return read_target_embedding(path, model.config.vocab_size, model.config.hidden_size)


def export_speculators(
    model: Eagle3Drafter, output: str, architectures: list[str] | None = None, target: str | None = None
) -> str:
    """Write ``model`` in the speculators layout (``vllm serve OUTPUT`` detects it), embedding included.

    Args:
        model: the draft (wrappers are unwrapped).
        output: directory, created if missing; our files in it are replaced.
        architectures: the verifier's architectures; None = read from the target's local config.json.
        target: where to read the embedding when the draft has none attached; None = ``config.target_path``.

    Returns:
        ``output``.
    """
    model = unwrap_draft(model)
    cfg = model.config
    warn_flags_older_engines_ignore("speculators", cfg, ("norm_before_fc", "fc_norm", "norm_output"), "vLLM")
    main, vh = draft_state(model)
    dtype = main["fc.weight"].dtype
    if cfg.draft_vocab_size == cfg.vocab_size:  # speculators keeps no mapping for the full vocab
        main = {k: v for k, v in main.items() if k not in ("d2t", "t2d")}
    main[EMBED_KEY] = export_embedding(model, target).to(dtype)
    data = speculators_config_dict(cfg, dtype, bool(vh), architectures)
    return write_draft_files(output, to_speculators_names(main), vh, data, remove_stale_vh=False)


def parse_speculators_config(config: dict[str, Any], directory: str) -> Eagle3Config:
    """A speculators EAGLE-3 config -> :class:`Eagle3Config` (speculators' / vLLM's defaults for absent keys)."""
    layer_config = config.get("transformer_layer_config")
    if not isinstance(layer_config, dict):
        raise VatError(f"{directory}: speculators config lacks transformer_layer_config")
    if layer_config.get("model_type", "llama") != "llama":
        raise VatError(
            f"{directory}: draft layer type {layer_config['model_type']!r} is not supported (vat's EAGLE-3 draft is "
            "a Llama layer: no q/k norms)"
        )
    values = parse_llama_config(layer_config, directory)
    values["draft_vocab_size"] = int(config.get("draft_vocab_size") or SPECULATORS_DRAFT_VOCAB_DEFAULT)
    values["target_hidden_size"] = int(config.get("target_hidden_size") or values["hidden_size"])
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    values["aux_layer_ids"] = vllm_to_vat_aux_ids(ids) if ids else None
    values["norm_before_residual"] = bool(config.get("norm_before_residual", True))  # vLLM's loader default
    values["norm_before_fc"] = bool(config.get("norm_before_fc", False))
    values["fc_norm"] = bool(config.get("fc_norm", False))
    values["norm_output"] = bool(config.get("norm_output", False))
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or []
    if methods and methods[0].get("speculative_tokens"):
        values["ttt_steps"] = int(methods[0]["speculative_tokens"])
    verifier = spec.get("verifier") or {}
    if verifier.get("name_or_path"):
        values["target_path"] = verifier["name_or_path"]
    apply_vat_block(values, config.get("vat"), directory)
    return Eagle3Config(**values)


def is_speculators_config(config: dict[str, Any]) -> bool:
    """``speculators_model_type`` present; any type other than ``eagle3`` stops with one line."""
    if "speculators_model_type" not in config:
        return False
    if config["speculators_model_type"] != "eagle3":
        raise VatError(f"speculators model type {config['speculators_model_type']!r} is not an EAGLE-3 draft")
    return True


register_format(DraftFormat("speculators", 1, is_speculators_config, parse_speculators_config))
