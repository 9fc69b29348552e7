"""LoRA fine-tuning of an (imported) EAGLE-3 draft through ``peft`` (``train.lora``).

Adapters are injected in place with :func:`peft.inject_adapter_in_model` into the Linear layers of the draft's decoder
layer named by ``train.lora.target_modules`` (the draft stays an :class:`~vat.drafters.eagle3.Eagle3Drafter`, so DDP,
FSDP and the TTT forward are unchanged). Trainable afterwards: the adapters, the verification head (fully) and ``fc``
when ``train.lora.train_fc``; every other weight is frozen.

Checkpoints keep the adapters unmerged in ``trainer_state.pt`` (resume continues them exactly); every draft directory
vat writes (``final/``, ``checkpoints/step_N/``, hence ``vat export``) holds MERGED weights in the original layout,
``W = W_base + scaling · B @ A`` (peft's own delta and scaling, see :func:`merged_state_dict`), so the engines load
it unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vat.errors import VatError

ADAPTER = "default"
VH_PREFIX = "verification_head."
FULLY_TRAINED = ("verification_head.",)  # trained in full next to the adapters (and fc. with train_fc)


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The peft LoRA layers of ``model`` by qualified name (empty when none were injected)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def apply_lora(drafter: nn.Module, lora_cfg: Any) -> list[str]:
    """Inject LoRA adapters into ``drafter`` in place and set what trains.

    Args:
        drafter: an unwrapped :class:`~vat.drafters.eagle3.Eagle3Drafter`.
        lora_cfg: ``train.lora`` (``r``, ``alpha``, ``dropout``, ``target_modules``, ``train_fc``).

    Returns:
        The qualified names of the adapted Linear layers.

    Raises:
        VatError: a bad rank / alpha / dropout, target modules that match nothing, or that name a layer which trains
            in full (the verification head, or ``fc`` with ``train_fc``).
    """
    from peft import LoraConfig, inject_adapter_in_model

    r, alpha, dropout = int(lora_cfg.r), float(lora_cfg.alpha), float(lora_cfg.dropout)
    if r < 1 or alpha <= 0 or not 0.0 <= dropout < 1.0:
        raise VatError(f"train.lora needs r >= 1, alpha > 0 and 0 <= dropout < 1, got r={r} alpha={alpha} "
                       f"dropout={dropout}")
    targets = [str(t) for t in lora_cfg.target_modules]
    linear = [n for n, m in drafter.named_modules() if isinstance(m, nn.Linear)]
    matched = [n for n in linear if any(n == t or n.endswith("." + t) for t in targets)]
    if not matched:
        raise VatError(f"train.lora.target_modules {targets} match no Linear layer of the draft "
                       f"(its Linear layers: {', '.join(linear)})")
    full = FULLY_TRAINED + (("fc.",) if lora_cfg.train_fc else ())
    clash = [n for n in matched if any((n + ".").startswith(p) for p in full)]
    if clash:
        raise VatError(f"train.lora.target_modules adapt {clash}, which train in full (the verification head, and fc "
                       "with train.lora.train_fc): drop them from target_modules")
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=matched, bias="none")
    inject_adapter_in_model(config, drafter, adapter_name=ADAPTER)  # freezes every non-adapter weight
    for name, param in drafter.named_parameters():
        if any(name.startswith(p) for p in full):
            param.requires_grad_(True)
    return matched


def merged_state_dict(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The draft's weights with every LoRA adapter merged, under the original (pre-injection) names.

    ``W = W_base + scaling · B @ A`` (transposed when the layer is ``fan_in_fan_out``): peft's
    ``LoraLayer.get_delta_weight`` for a Linear adapter, computed here from ``state`` so that gathered (FSDP) full
    tensors can be merged without touching the live, possibly sharded, model.

    Args:
        model: the draft with adapters (unwrapped; only its module tree and scalings are read).
        state: its full state dict; None = ``model.state_dict()``.

    Returns:
        A state dict that loads strictly into a draft built from the same config without adapters.
    """
    state = dict(model.state_dict() if state is None else state)
    for name, module in lora_modules(model).items():
        if getattr(module, "use_dora", {}).get(ADAPTER, False):
            raise VatError("DoRA adapters are not supported by vat's merge")
        base = state.pop(f"{name}.base_layer.weight")
        a = state.pop(f"{name}.lora_A.{ADAPTER}.weight")  # (r, in)
        b = state.pop(f"{name}.lora_B.{ADAPTER}.weight")  # (out, r)
        delta = (b.float() @ a.float()) * module.scaling[ADAPTER]  # (out, in)
        if getattr(module, "fan_in_fan_out", False):
            delta = delta.T
        if module.merged:  # adapters already folded into the base weight: nothing to add
            delta = torch.zeros_like(delta)
        state[f"{name}.weight"] = (base.float() + delta.to(base.device)).to(base.dtype)
        bias = state.pop(f"{name}.base_layer.bias", None)
        if bias is not None:
            state[f"{name}.bias"] = bias
    leftover = [k for k in state if ".lora_" in k or ".base_layer." in k]
    if leftover:
        raise VatError(f"unmerged adapter weights left after the merge: {leftover[:4]}")
    return state


def merged_draft(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A new adapter-free draft of ``model``'s class (CPU, no embedding attached) holding its merged weights.

    Also what the trainer writes from a gathered FSDP2 state (no adapters: the state as is). The live model is left
    untouched (training continues after a checkpoint).
    """
    cls = type(model)
    from torch.distributed.fsdp import FSDPModule

    if issubclass(cls, FSDPModule):  # FSDP2 swaps in a subclass: build the plain drafter class
        cls = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    with torch.random.fork_rng(devices=[]):  # a checkpoint must not move the run's RNG (exact resume)
        merged = cls(model.config)
    merged.load_state_dict({k: v.detach().cpu() for k, v in merged_state_dict(model, state).items()}, strict=True)
    return merged.eval()
