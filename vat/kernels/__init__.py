"""Budgeted fused-MoE experts forward (Triton) with a torch reference and transformers registration.

Modules: :mod:`.align` (pairs grouped by expert, sentinel slots skipped), :mod:`.fused_moe` (the two grouped-GEMM
kernels and :func:`~.fused_moe.fused_experts`), :mod:`.reference` (per-expert torch loop), :mod:`.layout` (weight
layouts and gated activations), :mod:`.registry` (``register_triton_experts() -> "vat_triton"``).

Importing a kernel module decides compiled vs interpreted Triton: set ``TRITON_INTERPRET=1`` before the first import
to run on CPU tensors. The names below are therefore resolved lazily, on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "register_triton_experts": "registry",
    "check_triton_experts_supported": "registry",
    "experts_layout": "registry",
    "EXPERTS_IMPL_NAME": "registry",
    "fused_experts": "fused_moe",
    "record_experts_read": "fused_moe",
    "ExpertsRead": "fused_moe",
    "KernelConfig": "fused_moe",
    "fused_experts_reference": "reference",
    "align_block_size": "align",
    "Alignment": "align",
    "ExpertsLayout": "layout",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
