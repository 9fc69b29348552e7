"""Budgeted fused-MoE experts forward (Triton) with a torch reference and transformers registration.

Modules: :mod:`.align` (pairs grouped by expert, sentinel slots skipped), :mod:`.fused_moe` (the two grouped-GEMM
kernels and :func:`~.fused_moe.fused_experts`), :mod:`.reference` (per-expert torch loop), :mod:`.layout` (weight
layouts and gated activations), :mod:`.registry` (``register_triton_experts() -> "vat_triton"``).

Importing a kernel module decides compiled vs interpreted Triton: set ``TRITON_INTERPRET=1`` before the first import
to run on CPU tensors. This package's ``__init__`` therefore imports no kernel module.
"""
