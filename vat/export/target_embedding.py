"""The target's input-embedding table, read on its own from the target's weight files (for exports that ship it).

speculators' ``Eagle3DraftModel`` keeps ``embed_tokens.weight`` in its checkpoints and its ``from_pretrained``
zero-fills the key when it is missing, so vat's speculators export writes the target's table under that name. A vat
draft holds the table unregistered (never saved), so the exporter takes it from the draft when attached, otherwise
from the target directory recorded in the draft's config. Only the one tensor is read, never the whole target.
"""

from __future__ import annotations

import json
import os

import torch
from huggingface_hub import hf_hub_download, snapshot_download
from safetensors import safe_open

from vat.errors import VatError
from vat.target.model import resolve_target_path

# where transformers causal LMs keep the input embedding (plain, multimodal wrappers, GPT-2 style)
EMBEDDING_KEYS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "embed_tokens.weight",
    "transformer.wte.weight",
)
INDEX_FILE = "model.safetensors.index.json"


def _target_dir(path: str) -> str:
    """A local directory holding the target's weights (``tiny`` names resolved, hub names fetched: index + json)."""
    path = resolve_target_path(path)
    if os.path.isdir(path):
        return path
    try:
        return snapshot_download(path, allow_patterns=["*.json"])
    except Exception as err:  # noqa: BLE001 - any hub failure is one line for the user
        raise VatError(
            f"cannot find target {path!r} for its embedding ({type(err).__name__}); pass a local target"
        ) from None


def _shard_with_key(directory: str) -> tuple[str, str]:
    """(safetensors file name, tensor name) of the embedding in a target directory."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        names = dict(weight_map)
    else:
        names = {}
        for file in sorted(os.listdir(directory)):
            if file.endswith(".safetensors"):
                with safe_open(os.path.join(directory, file), "pt") as f:
                    names.update({k: file for k in f.keys()})
    for key in EMBEDDING_KEYS:
        if key in names:
            return names[key], key
    endings = [k for k in names if k.endswith("embed_tokens.weight")]
    if endings:
        return names[endings[0]], endings[0]
    raise VatError(f"no input-embedding tensor ({EMBEDDING_KEYS[0]}, ...) in the safetensors files of {directory}")


def read_target_embedding(target_path: str, vocab_size: int, hidden_size: int) -> torch.Tensor:
    """The (V, H) input-embedding table of a target, read alone from its safetensors files.

    Args:
        target_path: a local target directory, ``tiny`` / ``tiny-quick``, or a hub name.
        vocab_size: expected rows V (the draft's ``vocab_size``).
        hidden_size: expected width H (the draft's ``hidden_size``).

    Raises:
        VatError: the target or the tensor cannot be found, or its shape is not (V, H).
    """
    directory = _target_dir(target_path)
    file, key = _shard_with_key(directory)
    path = os.path.join(directory, file)
    if not os.path.isfile(path):  # a hub snapshot fetched only the index: fetch the one shard
        path = hf_hub_download(target_path, file)
    with safe_open(path, "pt") as f:
        weight = f.get_tensor(key)
    if tuple(weight.shape) != (vocab_size, hidden_size):
        raise VatError(
            f"target {target_path}: {key} has shape {tuple(weight.shape)}, the draft expects ({vocab_size}, "
            f"{hidden_size}) (vocab, hidden)"
        )
    return weight
