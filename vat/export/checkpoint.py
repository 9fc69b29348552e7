"""vat's draft checkpoint directory, and format detection for loading any EAGLE-3 draft back into vat.

A vat EAGLE-3 checkpoint directory (written by the trainer through :func:`save_draft`)::

    config.json                     {"vat_format": "eagle3", "vat_format_version": 1, every Eagle3Config field,
                                     "aux_layer_convention": "layer_output_0_indexed", "aux_layer_ids_sglang",
                                     "aux_layer_ids_vllm", "torch_dtype"}
    model.safetensors               every draft weight under SGLang's names, plus d2t / t2d; NO embedding
    verification_head.safetensors   verification_head.weight (1, H), verification_head.bias (1,) -- when the draft
                                    has a verification head

:func:`load_draft` reads that, an SGLang export (``LlamaForCausalLMEagle3``) or a speculators export
(``speculators_model_type: eagle3``) and returns the same :class:`Eagle3Drafter`. See ``docs/export.md``.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch

from vat.drafters.eagle3 import Eagle3Config, Eagle3Drafter, identity_vocab_mapping
from vat.errors import VatError
from vat.target.conventions import (
    VAT_AUX_CONVENTION,
    VAT_AUX_CONVENTION_NOTE,
    vat_to_sglang_aux_ids,
    vat_to_vllm_aux_ids,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
VH_FILE = "verification_head.safetensors"
VAT_FORMAT_VERSION = 1
# config.json keys of a vat checkpoint that are labels, not Eagle3Config fields.
VAT_LABEL_KEYS = (
    "vat_format",
    "vat_format_version",
    "aux_layer_convention",
    "aux_layer_convention_note",
    "aux_layer_ids_sglang",
    "aux_layer_ids_vllm",
    "torch_dtype",
)


# ----------------------------------------------------------------------------------------------------------------------
# File helpers
# ----------------------------------------------------------------------------------------------------------------------


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write JSON atomically (temporary file + rename)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write a safetensors file atomically; tensors are moved to CPU and made contiguous."""
    from safetensors.torch import save_file

    tmp = f"{path}.tmp.{os.getpid()}"
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)


def read_json(path: str) -> dict[str, Any]:
    """Read a JSON object; a missing or malformed file raises one-line :class:`VatError`."""
    if not os.path.isfile(path):
        raise VatError(f"file not found: {path}")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise VatError(f"malformed JSON in {path}: {err}") from None
    if not isinstance(data, dict):
        raise VatError(f"{path} must hold a JSON object")
    return data


def read_weights(directory: str) -> dict[str, torch.Tensor]:
    """Read ``model.safetensors`` (or a legacy ``pytorch_model.bin``) from a draft directory."""
    from safetensors.torch import load_file

    path = os.path.join(directory, WEIGHTS_FILE)
    if os.path.isfile(path):
        return load_file(path)
    legacy = os.path.join(directory, "pytorch_model.bin")
    if os.path.isfile(legacy):
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise VatError(f"no {WEIGHTS_FILE} in draft directory {directory}")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling of ``torch_dtype`` in HF configs)."""
    return str(dtype).replace("torch.", "")


def draft_state(model: Eagle3Drafter) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split a draft's state into (main weights incl. d2t/t2d, verification-head weights). No embedding.

    Wrapper prefixes (``module.`` from DDP, ``_orig_mod.`` from torch.compile) are stripped and sharded tensors
    gathered, so the trainer may pass what it holds.
    """
    main: dict[str, torch.Tensor] = {}
    vh: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        for prefix in ("module.", "_orig_mod."):
            while name.startswith(prefix):
                name = name[len(prefix) :]
        if hasattr(tensor, "full_tensor"):  # DTensor (FSDP2)
            tensor = tensor.full_tensor()
        if name.startswith("embed_tokens."):
            continue
        (vh if name.startswith("verification_head.") else main)[name] = tensor
    return main, vh


def _unwrap(model: Any) -> Eagle3Drafter:
    while not isinstance(model, Eagle3Drafter) and hasattr(model, "module"):
        model = model.module
    model = getattr(model, "_orig_mod", model)
    if not isinstance(model, Eagle3Drafter):
        raise TypeError(f"expected an Eagle3Drafter, got {type(model).__name__}")
    return model


# ----------------------------------------------------------------------------------------------------------------------
# vat format
# ----------------------------------------------------------------------------------------------------------------------


def vat_config_dict(cfg: Eagle3Config, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of a vat checkpoint: the format tag, every config field and the labelled aux ids."""
    data: dict[str, Any] = {"vat_format": "eagle3", "vat_format_version": VAT_FORMAT_VERSION}
    data.update(cfg.to_dict())
    data["aux_layer_convention"] = VAT_AUX_CONVENTION
    data["aux_layer_convention_note"] = VAT_AUX_CONVENTION_NOTE
    ids = cfg.aux_layer_ids
    data["aux_layer_ids_sglang"] = vat_to_sglang_aux_ids(ids) if ids is not None else None
    data["aux_layer_ids_vllm"] = vat_to_vllm_aux_ids(ids) if ids is not None else None
    data["torch_dtype"] = dtype_name(dtype)
    return data


def save_draft(model: Eagle3Drafter, cfg: Eagle3Config | None, directory: str) -> str:
    """Write a vat EAGLE-3 checkpoint (config.json, model.safetensors, optional verification_head.safetensors).

    Each file is written to a temporary name and renamed. The embedding is never written.

    Args:
        model: the draft (DDP / compile wrappers are unwrapped).
        cfg: its config; None = ``model.config``.
        directory: created if missing; files already there are replaced.

    Returns:
        ``directory``.
    """
    model = _unwrap(model)
    cfg = cfg or model.config
    os.makedirs(directory, exist_ok=True)
    main, vh = draft_state(model)
    write_safetensors(os.path.join(directory, WEIGHTS_FILE), main)
    vh_path = os.path.join(directory, VH_FILE)
    if vh:
        write_safetensors(vh_path, vh)
    elif os.path.exists(vh_path):
        os.remove(vh_path)  # a stale head from an earlier save must not be picked up
    write_json(os.path.join(directory, CONFIG_FILE), vat_config_dict(cfg, main["fc.weight"].dtype))
    return directory


def read_vat(config: dict[str, Any], directory: str) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """Parse a vat checkpoint's config.json and weights."""
    if config.get("vat_format") != "eagle3":
        raise VatError(f"{directory} holds a vat {config.get('vat_format')!r} checkpoint, not an EAGLE-3 draft")
    version = config.get("vat_format_version", VAT_FORMAT_VERSION)
    if version > VAT_FORMAT_VERSION:
        raise VatError(f"{directory} was written by a newer vat (format version {version} > {VAT_FORMAT_VERSION})")
    convention = config.get("aux_layer_convention", VAT_AUX_CONVENTION)
    if convention != VAT_AUX_CONVENTION:
        raise VatError(f"{directory}: aux_layer_convention {convention!r}, expected {VAT_AUX_CONVENTION!r}")
    cfg = Eagle3Config.from_dict({k: v for k, v in config.items() if k not in VAT_LABEL_KEYS})
    return cfg, read_weights(directory)


# ----------------------------------------------------------------------------------------------------------------------
# Detection and loading
# ----------------------------------------------------------------------------------------------------------------------


def detect_format(config: dict[str, Any]) -> str:
    """``"vat"``, ``"speculators"`` or ``"sglang"`` from a draft's config.json; otherwise :class:`VatError`."""
    if "vat_format" in config:
        return "vat"
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise VatError(f"speculators model type {config['speculators_model_type']!r} is not an EAGLE-3 draft")
        return "speculators"
    archs = config.get("architectures") or []
    if any("Eagle3" in a for a in archs) or (archs == ["LlamaForCausalLM"] and "draft_vocab_size" in config):
        return "sglang"
    raise VatError(f"not an EAGLE-3 draft config (architectures={archs}); expected a vat, SGLang or speculators export")


def normalize_state(state: dict[str, torch.Tensor], cfg: Eagle3Config, source: str) -> dict[str, torch.Tensor]:
    """Engine weight names -> vat's: strip ``model.``, ``layers.0.`` -> ``midlayer.``, drop embedding / verifier
    tensors; a missing d2t/t2d is the identity mapping only when the draft vocab is the full vocab."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith("model."):
            name = name[len("model.") :]
        if name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0.") :]
        if name.startswith(("embed_tokens.", "verifier_lm_head.", "verifier_norm.")):
            continue
        out[name] = tensor
    if "d2t" not in out or "t2d" not in out:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise VatError(
                f"{source}: draft vocab {cfg.draft_vocab_size} < target vocab {cfg.vocab_size} but the weights have no "
                "d2t/t2d mapping (serving would map draft ids to the first target ids)"
            )
        out["d2t"], out["t2d"] = identity_vocab_mapping(cfg.vocab_size, cfg.draft_vocab_size)
    return out


def load_draft(
    directory: str,
    embed_weight: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Eagle3Drafter, Eagle3Config]:
    """Load an EAGLE-3 draft written by vat, exported for SGLang, or in the speculators (vLLM) layout.

    Args:
        directory: the draft directory (``config.json`` + ``model.safetensors``).
        embed_weight: (V, H) the target's input embeddings; None = attach later with ``model.set_embedding``.
        device: where to put the model (default CPU).
        dtype: parameter dtype; None = the stored weights' dtype.

    Returns:
        ``(model, cfg)``: the draft in eval mode (without an embedding unless given) and its config.

    Raises:
        VatError: missing files, an unrecognised config, or weights that do not fit the config.
    """
    from vat.export import sglang, speculators

    if not os.path.isdir(directory):
        raise VatError(f"draft directory not found: {directory}")
    config = read_json(os.path.join(directory, CONFIG_FILE))
    fmt = detect_format(config)
    if fmt == "vat":
        cfg, state = read_vat(config, directory)
    elif fmt == "sglang":
        cfg, state = sglang.read_sglang(config, directory)
    else:
        cfg, state = speculators.read_speculators(config, directory)
    state = normalize_state(state, cfg, directory)

    vh_path = os.path.join(directory, VH_FILE)
    if os.path.isfile(vh_path):
        from safetensors.torch import load_file

        state.update(load_file(vh_path))
        cfg.verification_head = True
    elif cfg.verification_head:
        raise VatError(f"{directory}: config has a verification head but {VH_FILE} is missing")

    model = Eagle3Drafter(cfg)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        first = str(err).replace("\n", " ").replace("\t", "")
        raise VatError(f"weights in {directory} do not fit its config: {first[:400]}") from None
    model.set_vocab_mapping(model.d2t, model.t2d)  # validates the loaded mapping
    model.to(device=device or "cpu", dtype=dtype or state["fc.weight"].dtype)
    if embed_weight is not None:
        model.set_embedding(embed_weight)
    return model.eval(), cfg


def warn_unsupported(fmt: str, what: str) -> None:
    """A flag some engine versions ignore: warn (never silent) but still write it."""
    warnings.warn(f"{fmt} export: {what}", stacklevel=3)
