"""Register the Triton experts forward in transformers' experts registry (``ExpertsInterface``), no monkeypatching.

Usage (what the frozen-target loader does for ``target.experts_impl: triton``)::

    from vat.kernels.registry import check_triton_experts_supported, register_triton_experts

    name = register_triton_experts()          # "vat_triton", idempotent
    check_triton_experts_supported(model)     # optional: refuse unsupported experts before the first forward
    model.set_experts_implementation(name)    # back with model.set_experts_implementation("eager")

Supported experts modules: every ``@use_experts_implementation`` module with gated experts whose gate is the default
``act_fn(gate) * up`` with ``act_fn`` = SiLU (OLMoE, Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3; concatenated or
interleaved, transposed or not, with or without biases), plus GPT-OSS's clamped GLU, with float32 / bfloat16 /
float16 weights. Anything else (FP8 or otherwise quantized experts included) raises :class:`vat.errors.VatError`
with the reason.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from vat.errors import VatError

from .fused_moe import check_weight_dtypes, fused_experts
from .layout import ExpertsLayout

EXPERTS_IMPL_NAME = "vat_triton"


def _is_silu(act_fn: object) -> bool:
    if isinstance(act_fn, nn.SiLU):
        return True
    # transformers' ACT2FN["silu"] is its own SiLUActivation module (hub-kernel decorated), not nn.SiLU.
    return type(act_fn).__name__ in ("SiLUActivation", "SiLU") or act_fn is torch.nn.functional.silu


def experts_layout(experts: nn.Module) -> ExpertsLayout:
    """The :class:`ExpertsLayout` of a transformers experts module, or a clear refusal.

    Args:
        experts: a module decorated with transformers' ``@use_experts_implementation`` (e.g. ``OlmoeExperts``).

    Raises:
        VatError: the module is not a gated experts module the kernel implements.
    """
    name = type(experts).__name__
    if not hasattr(experts, "gate_up_proj") or not getattr(experts, "has_gate", False):
        raise VatError(f"experts_impl triton: {name} has no fused gate_up_proj (non-gated experts are not supported)")
    # dtype first: transformers' FP8Experts dispatch through their own FP8ExpertsInterface, where "vat_triton" is
    # not registered (a KeyError at the first forward), and plain experts holding fp8 weights would run scale-free
    check_weight_dtypes(f"experts_impl triton: {name} ", experts.gate_up_proj, experts.down_proj)
    scales = sorted(n for n, _ in experts.named_parameters(recurse=False) if n.endswith(("scale_inv", "_scale")))
    if scales:
        raise VatError(
            f"experts_impl triton: {name} is quantized ({', '.join(scales)}); the kernel runs unquantized experts only "
            "— use experts_impl grouped_mm for this target"
        )
    if getattr(experts, "has_post_expert_norm", False):
        raise VatError(f"experts_impl triton: {name} applies a post-expert norm, which the kernel does not implement")
    transposed = bool(getattr(experts, "is_transposed", False))
    concatenated = bool(getattr(experts, "is_concatenated", True))
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if apply_gate is not None and apply_gate.__name__ == "_default_apply_gate":
        act_fn = getattr(experts, "act_fn", None)
        if not _is_silu(act_fn):
            raise VatError(
                f"experts_impl triton: {name} uses activation {type(act_fn).__name__}; only SiLU-gated experts "
                "(and GPT-OSS's clamped GLU) are implemented — use experts_impl eager or grouped_mm"
            )
        return ExpertsLayout(is_transposed=transposed, is_concatenated=concatenated, activation="silu")
    if name == "GptOssExperts":
        return ExpertsLayout(
            is_transposed=transposed,
            is_concatenated=concatenated,
            activation="gpt_oss_glu",
            alpha=float(experts.alpha),
            limit=float(experts.limit),
        )
    raise VatError(
        f"experts_impl triton: {name} defines its own gate function, which the kernel does not implement — "
        "use experts_impl eager or grouped_mm"
    )


def triton_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers experts-function signature around :func:`vat.kernels.fused_moe.fused_experts`.

    Args:
        self: the experts module (its ``gate_up_proj``, ``down_proj``, optional biases and flags are read).
        hidden_states: ``(T, H)``.
        top_k_index: ``(T, k)`` expert ids; ``self.num_experts`` marks a slot dropped by an expert budget.
        top_k_weights: ``(T, k)`` routing weights.

    Returns:
        ``(T, H)`` in ``hidden_states.dtype``.
    """
    layout = experts_layout(self)
    has_bias = bool(getattr(self, "has_bias", False))
    return fused_experts(
        hidden_states,
        self.gate_up_proj,
        self.down_proj,
        top_k_index,
        top_k_weights,
        gate_up_bias=self.gate_up_proj_bias if has_bias else None,
        down_bias=self.down_proj_bias if has_bias else None,
        layout=layout,
    )


def register_triton_experts() -> str:
    """Register :func:`triton_experts_forward` as transformers experts implementation ``"vat_triton"`` (idempotent).

    Returns:
        The implementation name to pass to ``model.set_experts_implementation``.
    """
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPL_NAME, triton_experts_forward)
    return EXPERTS_IMPL_NAME


def check_triton_experts_supported(model: nn.Module) -> int:
    """Refuse early (before any forward) if some experts module of ``model`` is not supported.

    Returns:
        The number of experts modules found.

    Raises:
        VatError: an unsupported experts module (layout, activation, weight dtype, quantization), or none at all.
    """
    found = 0
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "is_transposed"):
            experts_layout(module)
            found += 1
    if not found:
        raise VatError(f"experts_impl triton: {type(model).__name__} has no transformers 5.x experts modules")
    return found
