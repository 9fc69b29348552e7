"""The target as a run from a capture (``data.capture``) sees it: its config, input embedding, final norm and LM head
loaded from the checkpoint (no decoder layer, no expert), and the captured features turned into the
:class:`vat.target.TargetOutput` the online forward gives (logits = LM head(final norm(last hidden))).

:func:`load_captured_target` checks the capture against the run's target in one line (model type, hidden size,
vocabulary, layers, and the aux layers the draft reads); the capture's layout is :mod:`vat.data_prep.capture_store`.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
from huggingface_hub import hf_hub_download
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from vat.errors import VatError
from vat.target.conventions import default_aux_layer_ids
from vat.target.families import adapter_for
from vat.target.model import TargetOutput, _resolve_dtype, resolve_target_path


class CapturedTarget:
    """The parts of a target a capture-fed run keeps, with the facts the trainer asks of a :class:`FrozenTarget`.

    Args:
        config: the target's transformers config.
        path: where the target was read from.
        modules: ``embed`` (nn.Embedding), ``norm`` (the final norm, the target's own class), ``head`` (nn.Linear).
        captured: the capture manifest's ``target`` (identity, routing shape, captured aux layer ids; ``last:
            normed`` when the stored last hidden state is already the final norm's output, as speculators' is).
        aux_layer_ids: the layers the run's draft reads (default EAGLE-3's); a subset of the captured ones.
    """

    def __init__(self, config: Any, path: str, modules: dict[str, nn.Module], captured: dict[str, Any],
                 aux_layer_ids: list[int] | None):
        self.config, self.path, self.captured = config, path, captured
        self.embed, self.norm, self.head = modules["embed"], modules["norm"], modules["head"]
        self.num_layers = int(config.num_hidden_layers)
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(self.num_layers)
        self.num_experts, self.top_k = int(captured["num_experts"]), int(captured["top_k"])
        self.moe_layer_ids = list(captured["moe_layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.head.weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def embed_tokens(self) -> nn.Module:
        """The target's input embedding (the drafts read it)."""
        return self.embed

    def lm_head(self) -> nn.Module:
        """The target's LM head."""
        return self.head

    def final_norm(self) -> nn.Module:
        """The target's final norm (before the LM head)."""
        return self.norm

    def aux_columns(self) -> torch.Tensor | None:
        """Feature columns of the run's aux layers in the captured ``(T, n_aux*H)`` rows (None: all, in order).

        Raises:
            VatError: the draft reads a layer the capture lacks.
        """
        captured = list(self.captured["aux_layer_ids"])
        if captured == self.aux_layer_ids:
            return None
        lacking = [i for i in self.aux_layer_ids if i not in captured]
        if lacking:
            raise VatError(f"the draft reads target layers {self.aux_layer_ids} but the capture holds {captured} "
                           f"(not {lacking}): capture again with --aux-layer-ids {' '.join(map(str, self.aux_layer_ids))}")
        h = self.hidden_size
        return torch.cat([torch.arange(captured.index(i) * h, (captured.index(i) + 1) * h) for i in self.aux_layer_ids])

    @torch.no_grad()
    def forward_features(self, aux: torch.Tensor, last: torch.Tensor, routing: torch.Tensor | None) -> TargetOutput:
        """The online forward's output from captured features.

        Args:
            aux: (B, T, n_captured * H) captured aux hidden states.
            last: (B, T, H) the last decoder layer's output.
            routing: (L', B, T, k) executed expert ids, or None (a capture without routing).
        """
        columns = self.aux_columns()
        if columns is not None:
            aux = aux[..., columns.to(aux.device)]  # (B, T, n_aux * H)
        last = last.to(self.dtype)
        final = last if self.captured.get("last") == "normed" else self.norm(last)  # (B, T, H)
        logits = self.head(final)  # (B, T, V)
        return TargetOutput(logits=logits, aux_hidden=aux.to(self.dtype), final_hidden=final, topk_ids=routing,
                            last_hidden=last)

    def close(self) -> None:
        """Nothing to release (no hooks): the same call as :meth:`FrozenTarget.close`."""


FINGERPRINT_STRIDE = 97  # every 97th row of the embedding and LM head (and the whole final norm) is hashed


def weights_fingerprint(embed: nn.Module, norm: nn.Module, head: nn.Module) -> str:
    """A hash of the embedding, final norm and LM head a capture-fed run keeps, rounded to bf16 first (a capture in
    bf16 and a run in fp32 of one checkpoint agree; another checkpoint of the same shapes does not)."""
    digest = hashlib.sha256()
    for weight in (norm.weight, embed.weight[::FINGERPRINT_STRIDE], head.weight[::FINGERPRINT_STRIDE]):
        digest.update(weight.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def check_capture_identity(config: Any, vocab_size: int, captured: dict[str, Any], path: str) -> None:
    """Stop in one line when the capture was taken from another target than ``path``."""
    mine = {"model_type": str(config.model_type), "hidden_size": int(config.hidden_size), "vocab_size": vocab_size,
            "num_layers": int(config.num_hidden_layers)}
    for key, value in mine.items():
        if captured.get(key) is not None and captured.get(key) != value:  # speculators' files record the hidden size only
            raise VatError(f"the capture was taken from a target with {key.replace('_', ' ')} {captured.get(key)} "
                           f"({captured.get('path')}) but target.path {path} has {value}: capture from this target, "
                           "or set target.path to the capture's")


def complete_capture_facts(captured: dict[str, Any], skeleton: nn.Module, aux_layer_ids: list[int] | None) -> dict:
    """A capture's ``target`` record with what speculators' files do not say filled in: the MoE shape from the
    target's own modules, the aux layers from the run (which must name as many as the files hold)."""
    facts = dict(captured)
    if facts.get("num_experts") is None:
        adapter = adapter_for(skeleton.config)
        blocks = list(adapter.moe_blocks(skeleton))
        if not blocks:
            raise VatError(f"{type(skeleton).__name__} has no MoE layers that vat recognises")
        router = adapter.router(blocks[0][1])
        facts.update(num_experts=int(router.num_experts), top_k=int(router.top_k),
                     moe_layer_ids=[layer for layer, _ in blocks])
    if facts.get("aux_layer_ids") is None:
        if aux_layer_ids is None or len(aux_layer_ids) != facts["num_aux"]:
            raise VatError(f"the capture holds {facts['num_aux']} aux layers but does not say which: set "
                           "target.aux_layer_ids to them in vat's convention (vLLM / speculators layer id - 1), "
                           f"{facts['num_aux']} ids")
        facts["aux_layer_ids"] = list(aux_layer_ids)
    return facts


def _checkpoint_tensors(path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors checkpoint (a local directory or a hub name), reading only their files."""
    def local(filename: str) -> str | None:
        if os.path.isdir(path):
            full = os.path.join(path, filename)
            return full if os.path.exists(full) else None
        try:
            return hf_hub_download(path, filename)
        except Exception:
            return None

    index = local("model.safetensors.index.json")
    if index is not None:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        weight_map = {name: "model.safetensors" for name in names}
    out: dict[str, torch.Tensor] = {}
    for filename in sorted({weight_map[n] for n in names if n in weight_map}):
        file = local(filename)
        if file is None:
            raise VatError(f"target {path} has no {filename}: a capture-fed run reads the embedding, final norm and "
                           "LM head from the target's safetensors")
        with safe_open(file, framework="pt", device="cpu") as f:
            out.update({n: f.get_tensor(n) for n in names if weight_map.get(n) == filename and n in f.keys()})
    return out


def load_captured_target(path: str, captured: dict[str, Any], *, dtype: str = "auto", device: Any = None,
                         aux_layer_ids: list[int] | None = None) -> CapturedTarget:
    """The target's embedding, final norm and LM head (and config), checked against a capture's ``target`` record.

    Args:
        path: the run's ``target.path`` (a directory, a hub name, or ``tiny`` / ``tiny-quick``).
        captured: the capture manifest's ``target``.
        dtype: as :func:`vat.target.load_target`'s.
        device: where the three modules go (default CUDA if available).
        aux_layer_ids: the layers the draft reads (default EAGLE-3's).
    """
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = resolve_target_path(path)
    try:
        config = AutoConfig.from_pretrained(resolved)
    except OSError as err:
        raise VatError(f"cannot load target `{resolved}`: {str(err).splitlines()[0]}") from None
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = {id(m): n for n, m in skeleton.named_modules()}
    modules = {"embed": skeleton.get_input_embeddings(), "head": skeleton.get_output_embeddings(),
               "norm": getattr(getattr(skeleton, "model", skeleton), "norm", None)}
    if modules["norm"] is None:
        raise VatError(f"{type(skeleton).__name__}: vat finds no final norm before the LM head; train online")
    keys = {part: [f"{names[id(m)]}.{p}" for p, _ in m.named_parameters()] for part, m in modules.items()}
    tensors = _checkpoint_tensors(resolved, [k for ks in keys.values() for k in ks])
    tied = bool(getattr(config, "tie_word_embeddings", False))
    torch_dtype = _resolve_dtype(dtype, device)
    for part, module in modules.items():
        state = {}
        for key in keys[part]:
            source = keys["embed"][0] if part == "head" and tied and key not in tensors else key
            if source not in tensors:
                raise VatError(f"target {resolved}: no tensor `{source}` in its checkpoint")
            state[key[len(names[id(module)]) + 1:]] = tensors[source].to(torch_dtype)
        module.to_empty(device=device).load_state_dict(state)
        module.requires_grad_(False)
    check_capture_identity(config, int(modules["head"].weight.shape[0]), captured, resolved)
    weights = weights_fingerprint(modules["embed"], modules["norm"], modules["head"])
    if captured.get("weights") not in (None, weights):  # speculators' files record none
        raise VatError(f"the capture was taken from a target whose embedding / final norm / LM head differ from "
                       f"target.path {resolved}'s (same shapes: another checkpoint of the model?): capture from this "
                       "target, or set target.path to the capture's")
    captured = complete_capture_facts(captured, skeleton, aux_layer_ids)
    return CapturedTarget(config, resolved, modules, captured, aux_layer_ids)
