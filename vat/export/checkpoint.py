"""The one module every draft layout depends on: file IO, the Llama-style config pieces, the ``vat`` block, vat's own
checkpoint layout, the format registry and :func:`load_draft`.

A vat EAGLE-3 checkpoint directory (written by the trainer through :func:`save_draft`)::

    config.json                     {"vat_format": "eagle3", "vat_format_version": 1, every Eagle3Config field,
                                     "aux_layer_convention": "layer_output_0_indexed", "aux_layer_ids_sglang",
                                     "aux_layer_ids_vllm", "torch_dtype"}
    model.safetensors               every draft weight under SGLang's names, plus d2t / t2d; NO embedding
    verification_head.safetensors   verification_head.weight (1, H), verification_head.bias (1,) -- when the draft
                                    has a verification head

A DFlash draft's checkpoint is the public DFlash release layout itself (:mod:`vat.export.dflash`, which registers its
loader and its writer here).

Dependencies run one way: :mod:`vat.export.sglang`, :mod:`vat.export.speculators` and :mod:`vat.export.dflash` import
this module and register their layout here (:func:`register_format`, :func:`register_writer`); this module imports
none of them. ``vat.export`` imports both, so every
layout is registered before anything can call :func:`load_draft`. See ``docs/export.md``.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file, save_file

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
EMBED_KEY = "embed_tokens.weight"  # speculators' name for the (target's) input embedding
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
# Eagle3Config fields an engine config may leave unset and the vat block fills
VAT_BLOCK_FIELDS = ("num_target_layers", "target_path", "ttt_steps", "vh_input", "norm_output", "sliding_window")


# ----------------------------------------------------------------------------------------------------------------------
# File helpers
# ----------------------------------------------------------------------------------------------------------------------


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file named by this process, then rename: a kill leaves the old
    file or the new one, and processes writing the same file at once leave one writer's whole text."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write JSON atomically (:func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write a safetensors file atomically; tensors are moved to CPU and made contiguous."""
    tmp = f"{path}.tmp.{os.getpid()}"
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)


def write_draft_files(
    directory: str,
    weights: dict[str, torch.Tensor],
    vh: dict[str, torch.Tensor],
    config: dict[str, Any],
    *,
    remove_stale_vh: bool,
) -> str:
    """Write a draft directory (created if missing), each file atomically: ``weights`` as model.safetensors, ``vh``
    (when not empty) as verification_head.safetensors and ``config`` as config.json.

    Args:
        remove_stale_vh: with no ``vh``, delete the verification head an earlier save left in ``directory`` (a
            checkpoint directory is saved into again and again; the engine exports leave it).

    Returns:
        ``directory``.
    """
    os.makedirs(directory, exist_ok=True)
    write_safetensors(os.path.join(directory, WEIGHTS_FILE), weights)
    vh_path = os.path.join(directory, VH_FILE)
    if vh:
        write_safetensors(vh_path, vh)
    elif remove_stale_vh and os.path.exists(vh_path):
        os.remove(vh_path)  # a stale head from an earlier save must not be picked up
    write_json(os.path.join(directory, CONFIG_FILE), config)
    return directory


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


def _unwrap(model: Any) -> Any:
    """The drafter inside DDP / FSDP / torch.compile wrappers."""
    while hasattr(model, "module") and not hasattr(model, "config"):
        model = model.module
    return getattr(model, "_orig_mod", model)


def unwrap_draft(model: Any) -> Eagle3Drafter:
    """The :class:`Eagle3Drafter` inside DDP / FSDP / torch.compile wrappers."""
    while not isinstance(model, Eagle3Drafter) and hasattr(model, "module"):
        model = model.module
    model = getattr(model, "_orig_mod", model)
    if not isinstance(model, Eagle3Drafter):
        raise TypeError(f"expected an Eagle3Drafter, got {type(model).__name__}")
    return model


def warn_unsupported(fmt: str, what: str, stacklevel: int = 3) -> None:
    """A flag some engine versions ignore: warn (never silent) but still write it."""
    warnings.warn(f"{fmt} export: {what}", stacklevel=stacklevel)


def warn_flags_older_engines_ignore(fmt: str, cfg: Eagle3Config, flags: tuple[str, ...], engine: str) -> None:
    """Warn once per boolean config flag in ``flags`` that is set: it is written to config.json, but ``engine``'s
    older builds ignore it (the warning points at the export's caller)."""
    for flag in flags:
        if getattr(cfg, flag):
            warn_unsupported(fmt, f"{flag}=true is written to config.json but older {engine} builds ignore it",
                             stacklevel=4)


# ----------------------------------------------------------------------------------------------------------------------
# Llama-style config pieces shared by the SGLang and speculators layouts
# ----------------------------------------------------------------------------------------------------------------------


def llama_config_dict(cfg: Eagle3Config, dtype: torch.dtype) -> dict[str, Any]:
    """The Llama-config part of an exported draft (one decoder layer; vocab_size = the TARGET vocabulary).

    A sliding-window draft also gets ``sliding_window``, ``use_sliding_window`` and ``layer_types``, as speculators'
    trainer writes them (its attention applies the window where ``layer_types`` says ``sliding_attention``).
    """
    data: dict[str, Any] = {
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
    if cfg.sliding_window is not None:
        data.update(sliding_window=cfg.sliding_window, use_sliding_window=True, layer_types=["sliding_attention"])
    return data


def parse_sliding_window(data: dict[str, Any], source: str) -> int | None:
    """The draft layer's attention window from a Llama-style config, as speculators / vLLM decide it.

    ``layer_types[0] == "sliding_attention"`` applies ``sliding_window``; ``full_attention`` or no ``layer_types``
    means full attention (speculators and vLLM both read the window through ``layer_types``; a bare
    ``sliding_window`` is ignored by them, so by vat too).
    """
    layer_types = data.get("layer_types")
    if not layer_types:
        return None
    if len(layer_types) != 1:
        raise VatError(f"{source}: layer_types lists {len(layer_types)} layers; vat's EAGLE-3 draft has 1")
    if layer_types[0] == "full_attention":
        return None
    if layer_types[0] != "sliding_attention":
        raise VatError(f"{source}: attention type {layer_types[0]!r} is not supported (full / sliding_attention)")
    window = data.get("sliding_window")
    if not window:
        raise VatError(f"{source}: layer_types says sliding_attention but sliding_window is {window!r}")
    return int(window)


def llama_layer_dims(data: dict[str, Any]) -> dict[str, int]:
    """A Llama-style draft config's layer sizes: hidden_size, intermediate_size, num_attention_heads,
    num_key_value_heads (default: the heads) and head_dim (default: hidden / heads).

    Raises:
        KeyError: a required key is missing (the caller names the file).
    """
    hidden = int(data["hidden_size"])
    heads = int(data["num_attention_heads"])
    return dict(
        hidden_size=hidden,
        intermediate_size=int(data["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or hidden // heads),
    )


def parse_llama_config(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Eagle3Config fields from a Llama-style draft config; unsupported variants raise :class:`VatError`."""
    try:
        values: dict[str, Any] = dict(llama_layer_dims(data), vocab_size=int(data["vocab_size"]))
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
        sliding_window=parse_sliding_window(data, source),
    )
    return values


# ----------------------------------------------------------------------------------------------------------------------
# The vat block of engine exports
# ----------------------------------------------------------------------------------------------------------------------


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
        "norm_output": cfg.norm_output,
        "sliding_window": cfg.sliding_window,
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
    for key in VAT_BLOCK_FIELDS:
        if block.get(key) is not None and values.get(key) is None:
            values[key] = block[key]
    if block.get("verification_head_file") and block.get("vh_input") is None:
        values.setdefault("vh_input", "prenorm")  # exported before the key existed: the head read the residual


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


# drafter class -> writer of its checkpoint (``(model, directory) -> directory``), for drafters other than EAGLE-3
WRITERS: dict[type, Callable[[Any, str], str]] = {}


def register_writer(cls: type, writer: Callable[[Any, str], str]) -> None:
    """Make :func:`save_draft` write drafters of class ``cls`` with ``writer`` (a layout module registers itself)."""
    WRITERS[cls] = writer


def save_draft(model: Any, cfg: Eagle3Config | None, directory: str) -> str:
    """Write a vat checkpoint: EAGLE-3 (config.json, model.safetensors, optional verification_head.safetensors), or
    the layout registered for another drafter class (DFlash: its release layout).

    Each file is written to a temporary name and renamed. The target's embedding (and LM head) is never written.

    Args:
        model: the draft (DDP / compile wrappers are unwrapped).
        cfg: its config; None = ``model.config``.
        directory: created if missing; files already there are replaced.

    Returns:
        ``directory``.
    """
    inner = _unwrap(model)
    if type(inner) in WRITERS:
        os.makedirs(directory, exist_ok=True)
        return WRITERS[type(inner)](inner, directory)
    model = unwrap_draft(model)
    cfg = cfg or model.config
    main, vh = draft_state(model)
    return write_draft_files(directory, main, vh, vat_config_dict(cfg, main["fc.weight"].dtype), remove_stale_vh=True)


def parse_vat_config(config: dict[str, Any], directory: str) -> Eagle3Config:
    """Parse a vat checkpoint's config.json."""
    if config.get("vat_format") != "eagle3":
        raise VatError(f"{directory} holds a vat {config.get('vat_format')!r} checkpoint, not an EAGLE-3 draft")
    version = config.get("vat_format_version", VAT_FORMAT_VERSION)
    if version > VAT_FORMAT_VERSION:
        raise VatError(f"{directory} was written by a newer vat (format version {version} > {VAT_FORMAT_VERSION})")
    convention = config.get("aux_layer_convention", VAT_AUX_CONVENTION)
    if convention != VAT_AUX_CONVENTION:
        raise VatError(f"{directory}: aux_layer_convention {convention!r}, expected {VAT_AUX_CONVENTION!r}")
    return Eagle3Config.from_dict({k: v for k, v in config.items() if k not in VAT_LABEL_KEYS})


# ----------------------------------------------------------------------------------------------------------------------
# Format registry and loading
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftFormat:
    """One on-disk draft layout, as :func:`load_draft` sees it.

    Attributes:
        name: ``"vat"``, ``"speculators"``, ``"sglang"``, ``"dflash"``.
        priority: detection order (lower first; speculators before SGLang, whose test would match it too).
        detect: config.json -> True when the layout is this one (may raise :class:`VatError` for a near miss).
        parse: (config.json, directory) -> the draft's config (:class:`Eagle3Config` for EAGLE-3 layouts).
        load: ``(directory, embed_weight, device, dtype) -> (model, cfg)`` for a layout of another drafter; None =
            an EAGLE-3 layout whose weights :func:`load_draft` reads itself.
    """

    name: str
    priority: int
    detect: Callable[[dict[str, Any]], bool]
    parse: Callable[[dict[str, Any], str], Any]
    load: Callable[..., tuple[Any, Any]] | None = None


FORMATS: dict[str, DraftFormat] = {}


def register_format(fmt: DraftFormat) -> None:
    """Make a layout loadable by :func:`load_draft` (each layout module registers itself at import)."""
    FORMATS[fmt.name] = fmt


register_format(DraftFormat("vat", 0, lambda config: "vat_format" in config, parse_vat_config))


def detect_format(config: dict[str, Any]) -> str:
    """``"vat"``, ``"speculators"`` or ``"sglang"`` from a draft's config.json; otherwise :class:`VatError`."""
    for fmt in sorted(FORMATS.values(), key=lambda f: f.priority):
        if fmt.detect(config):
            return fmt.name
    archs = config.get("architectures") or []
    raise VatError(f"not an EAGLE-3 draft or a DFlash draft config (architectures={archs}); expected a vat, SGLang "
                   "or speculators export, or the DFlash release layout")


def read_draft_config(directory: str) -> Any:
    """The config of a draft directory in any registered layout (weights are not read): :class:`Eagle3Config`, or
    :class:`vat.drafters.dflash.DFlashConfig` for a DFlash draft."""
    if not os.path.isdir(directory):
        raise VatError(f"draft directory not found: {directory}")
    config = read_json(os.path.join(directory, CONFIG_FILE))
    return FORMATS[detect_format(config)].parse(config, directory)


def normalize_state(
    state: dict[str, torch.Tensor], cfg: Eagle3Config, source: str
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Engine weight names -> vat's: strip ``model.``, ``layers.0.`` -> ``midlayer.``, drop verifier tensors; a missing
    d2t/t2d is the identity mapping only when the draft vocab is the full vocab.

    Returns:
        ``(state, embedding)``: the draft's weights under vat's names, and the shipped ``embed_tokens.weight`` (V, H)
        or None.
    """
    out: dict[str, torch.Tensor] = {}
    embedding = None
    for name, tensor in state.items():
        if name.startswith("model."):
            name = name[len("model.") :]
        if name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0.") :]
        if name == EMBED_KEY:
            embedding = tensor
            continue
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
    return out, embedding


def check_shipped_embedding(shipped: torch.Tensor, target: torch.Tensor, source: str) -> None:
    """A checkpoint that ships ``embed_tokens.weight`` must ship the target's (vat shares the target's, frozen)."""
    if tuple(shipped.shape) != tuple(target.shape):
        raise VatError(
            f"{source}: shipped embed_tokens.weight has shape {tuple(shipped.shape)}, the target's is "
            f"{tuple(target.shape)}"
        )
    a, b = shipped.detach().float().cpu(), target.detach().float().cpu()
    tol = 1e-2 if {torch.bfloat16, torch.float16} & {shipped.dtype, target.dtype} else 1e-5  # a cast is no change
    if not torch.allclose(a, b, atol=tol * float(b.abs().max().clamp(min=1.0)), rtol=tol):
        raise VatError(
            f"{source}: the shipped embed_tokens.weight differs from the target's embedding (trained with "
            "embed_requires_grad?); vat's draft reads the target's frozen embedding"
        )


def load_draft(
    directory: str,
    embed_weight: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Any, Any]:
    """Load an EAGLE-3 draft written by vat, exported for SGLang, or in the speculators (vLLM) layout; or a DFlash
    draft (its release layout; vat's DFlash checkpoints are that layout). A DFlash draft also needs the target's LM
    head: ``model.set_lm_head``.

    Args:
        directory: the draft directory (``config.json`` + ``model.safetensors``).
        embed_weight: (V, H) the target's input embeddings; None = attach later with ``model.set_embedding``. When the
            checkpoint ships ``embed_tokens.weight`` (speculators), it must equal this one.
        device: where to put the model (default CPU).
        dtype: parameter dtype; None = the stored weights' dtype.

    Returns:
        ``(model, cfg)``: the draft in eval mode (without an embedding unless given) and its config.

    Raises:
        VatError: missing files, an unrecognised config, or weights that do not fit the config.
    """
    if not os.path.isdir(directory):
        raise VatError(f"draft directory not found: {directory}")
    fmt = FORMATS[detect_format(read_json(os.path.join(directory, CONFIG_FILE)))]
    if fmt.load is not None:
        return fmt.load(directory, embed_weight, device, dtype)
    cfg = read_draft_config(directory)
    state, shipped_embedding = normalize_state(read_weights(directory), cfg, directory)

    add_verification_head(state, cfg, directory)
    model = Eagle3Drafter(cfg)
    load_strict(model, state, directory)
    model.set_vocab_mapping(model.d2t, model.t2d)  # validates the loaded mapping
    model.to(device=device or "cpu", dtype=dtype or state["fc.weight"].dtype)
    if embed_weight is not None:
        if shipped_embedding is not None:
            check_shipped_embedding(shipped_embedding, embed_weight, directory)
        model.set_embedding(embed_weight)
    return model.eval(), cfg


def add_verification_head(state: dict[str, torch.Tensor], cfg: Any, directory: str) -> None:
    """Add ``verification_head.safetensors`` of a draft directory to ``state`` (and mark ``cfg`` as having a head).

    Raises:
        VatError: the config names a head whose file is missing.
    """
    vh_path = os.path.join(directory, VH_FILE)
    if os.path.isfile(vh_path):
        state.update(load_file(vh_path))
        cfg.verification_head = True
    elif cfg.verification_head:
        raise VatError(f"{directory}: config has a verification head but {VH_FILE} is missing")


def load_strict(model: torch.nn.Module, state: dict[str, torch.Tensor], directory: str) -> None:
    """``model.load_state_dict(state, strict=True)``; a mismatch is one :class:`VatError` line naming ``directory``."""
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        first = str(err).replace("\n", " ").replace("\t", "")
        raise VatError(f"weights in {directory} do not fit its config: {first[:400]}") from None
