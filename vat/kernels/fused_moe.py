"""Budgeted fused-MoE experts forward: two Triton grouped GEMMs over the experts actually selected.

Pipeline for ``T`` tokens, top-``k`` routing, ``P = T·k`` (token, slot) pairs:

1. :func:`vat.kernels.align.align_block_size` groups the pairs by expert, padded per expert to ``BLOCK_M``; slots
   holding the sentinel ``num_experts`` (dropped by an expert budget) are left out, so an expert that no pair selects
   owns no M-block and its weights are never read.
2. gate_up GEMM, one program per (M-block, N-block of I): ``x[token] @ W_gate[e].T`` and ``x[token] @ W_up[e].T`` in two
   fp32 accumulators, then the gated activation (``silu(gate) * up``; GPT-OSS's clamped GLU) in fp32, stored per pair
   in the compute dtype: ``act (P, I)``.
3. down GEMM, one program per (M-block, N-block of H): ``act[pair] @ W_down[e].T`` in fp32, times the pair's routing
   weight *on the fp32 accumulator*, stored in fp32: ``y (P, H)`` (rows of dropped pairs stay zero).
4. ``y.view(T, k, H).sum(1)`` in fp32, cast once to ``hidden_states.dtype``. A token whose slots are all dropped gets 0.

Numerics: on a GPU the operands stay in the weights' dtype (bf16/fp16: native ``tl.dot``, fp32 accumulation; fp32:
``input_precision="ieee"``, no TF32). Under ``TRITON_INTERPRET=1`` (CPU tensors) every operand is upcast to fp32 first,
because the interpreter's bf16 arithmetic is wrong; the result is cast back to ``hidden_states.dtype``.

Launch configuration: on CUDA (and not interpreted) the kernels are wrapped in ``@triton.autotune`` over ``BLOCK_N``,
``BLOCK_K``, warps and stages, keyed by ``(num_experts, N, K, BLOCK_M)`` plus the tensors' dtypes (Triton adds those),
i.e. by (num_experts, hidden, intermediate, dtype). ``BLOCK_M`` is fixed by the caller because the alignment depends on
it. Passing an explicit :class:`KernelConfig` launches the raw ``@triton.jit`` kernels instead, which is the only path
the interpreter can take (the autotuner needs a GPU driver).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from vat.errors import VatError

from .align import Alignment, align_block_size
from .layout import STANDARD, ExpertsLayout

_ACTIVATION_CODE = {"silu": 0, "gpt_oss_glu": 1}


@triton.jit
def _gate_up_act_kernel(
    x_ptr,  # (T, H) activations
    w_ptr,  # (E, 2I, H) gate_up weights, addressed through strides (transposed layouts work unchanged)
    b_ptr,  # (E, 2I) bias, or any tensor when HAS_BIAS is False
    out_ptr,  # (P, I) activation cache, one row per pair
    sorted_ids_ptr,  # (num_padded,) pair ids grouped by expert, pad = num_pairs
    block_expert_ptr,  # (max_blocks,) expert of each M-block, -1 = unused
    num_pairs,
    num_experts,  # only part of the autotune key
    N,  # I
    K,  # H
    stride_xt,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_op,
    stride_on,
    gate_step,  # row of gate unit j is j * gate_step (1 concatenated, 2 interleaved)
    up_offset,  # row of up unit j is j * gate_step + up_offset (I concatenated, 1 interleaved)
    alpha,
    limit,
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 0 silu(gate) * up, 1 GPT-OSS clamped GLU
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 operands: exact fp32 dot, no TF32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)  # int64: E * 2I * H can pass 2**31
    if expert < 0:  # unused block past the last expert's run
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # int64 before any stride multiply: pair * stride_op passes 2**31 once T·k·H does (~37 k tokens at DeepSeek-V3)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)  # (BM,)
    row_ok = pair < num_pairs  # (BM,) padding rows are masked out
    token = pair // TOP_K  # (BM,) int64
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)  # (BK,)

    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xk  # (BM, BK)
    g_ptrs = w_ptr + expert * stride_we + (offs_n * gate_step)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + up_offset * stride_wn  # (BK, BN)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # (BM, BK)
        wg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # (BK, BN)
        wu = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # (BK, BN)
        if IEEE:
            acc_g = tl.dot(x, wg, acc_g, input_precision="ieee")
            acc_u = tl.dot(x, wu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(x, wg, acc_g)
            acc_u = tl.dot(x, wu, acc_u)
        x_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        b_gate = b_ptr + expert * stride_be + offs_n * gate_step * stride_bn  # (BN,)
        acc_g += tl.load(b_gate, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_gate + up_offset * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 0:
        act = acc_g * tl.sigmoid(acc_g) * acc_u  # (BM, BN) fp32
    else:
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        act = (u + 1.0) * g * tl.sigmoid(g * alpha)  # (BM, BN) fp32
    out_ptrs = out_ptr + pair[:, None] * stride_op + offs_n[None, :] * stride_on
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    a_ptr,  # (P, I) activation cache
    w_ptr,  # (E, H, I) down weights, addressed through strides
    b_ptr,  # (E, H) bias, or any tensor when HAS_BIAS is False
    topk_w_ptr,  # (P,) routing weight of each pair
    out_ptr,  # (P, H) fp32 weighted expert outputs, one row per pair
    sorted_ids_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,  # only part of the autotune key
    N,  # H
    K,  # I
    stride_ap,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_op,
    stride_on,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)  # (BM,) int64: pair * stride_op passes 2**31 first here
    row_ok = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + pair[:, None] * stride_ap + offs_k[None, :] * stride_ak  # (BM, BK)
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # (BK, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + offs_n * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    routing_w = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)  # (BM,)
    acc = acc * routing_w[:, None]  # weight the fp32 accumulator, before any downcast
    out_ptrs = out_ptr + pair[:, None] * stride_op + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


INTERPRETED = isinstance(_gate_up_act_kernel, InterpretedFunction)
"""True when this module was imported with ``TRITON_INTERPRET=1`` (kernels run on CPU tensors through numpy)."""


def _autotune_configs() -> list[triton.Config]:
    # (BLOCK_N, BLOCK_K, num_warps, num_stages). Verification-sized calls are weight-bandwidth bound with one M-block
    # per expert, so narrow N tiles (more programs in flight) and long K tiles (long contiguous weight reads) come
    # first; kept short because every config is compiled once per key.
    shapes = [(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in shapes]


if torch.cuda.is_available() and not INTERPRETED:
    _AUTOTUNE_KEY = ["num_experts", "N", "K", "BLOCK_M"]
    _gate_up_act_tuned = triton.autotune(configs=_autotune_configs(), key=_AUTOTUNE_KEY)(_gate_up_act_kernel)
    _down_tuned = triton.autotune(configs=_autotune_configs(), key=_AUTOTUNE_KEY)(_down_kernel)
else:
    _gate_up_act_tuned = _down_tuned = None


@dataclass(frozen=True)
class KernelConfig:
    """An explicit launch configuration (bypasses autotuning; required under the interpreter).

    Attributes:
        block_m: M-block size BM (pairs per program); also the alignment's padding unit. None: chosen from the shapes.
        block_n: N tile of both GEMMs (clipped to the next power of two of N, at least 16).
        block_k: K tile of both GEMMs (clipped likewise).
        num_warps: warps per program (GPU only).
        num_stages: software-pipelining stages (GPU only).
    """

    block_m: int | None = None
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        # tl.dot needs every tile side >= 16 and tl.arange a power of two: refuse here, not at the first compile
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value is None and name == "block_m":
                continue
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise VatError(f"KernelConfig.{name} must be a power of two >= 16 (tl.dot tiles), got {value}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1) or self.num_stages < 1:
            raise VatError(
                f"KernelConfig needs num_warps a power of two and num_stages >= 1, got {self.num_warps}, "
                f"{self.num_stages}"
            )


INTERPRETER_CONFIG = KernelConfig(block_n=128, block_k=128)
"""Large tiles: the interpreter's cost grows with programs × K-iterations."""


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """BM from the expected pairs per selected expert: 16 at decode / verification sizes, up to 64 for prefill."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


def _tile(requested: int, extent: int) -> int:
    return max(16, min(requested, triton.next_power_of_2(extent)))


@dataclass(frozen=True)
class ExpertsRead:
    """Which experts one fused-experts call scheduled, i.e. whose weights it read.

    Attributes:
        num_experts: E of the layer.
        experts: sorted expert ids that own at least one M-block.
        bytes_read: expert weight bytes those experts occupy (gate_up + down, + biases), in the stored dtype.
    """

    num_experts: int
    experts: tuple[int, ...]
    bytes_read: int


_RECORDERS: list[list[ExpertsRead]] = []


@contextlib.contextmanager
def record_experts_read() -> Iterator[list[ExpertsRead]]:
    """Collect an :class:`ExpertsRead` per :func:`fused_experts` call made inside the block (costs a host sync).

    Example::

        with record_experts_read() as calls:
            model(input_ids)
        calls[0].experts  # experts layer 0 read
    """
    calls: list[ExpertsRead] = []
    _RECORDERS.append(calls)
    try:
        yield calls
    finally:
        for i in range(len(_RECORDERS) - 1, -1, -1):
            if _RECORDERS[i] is calls:
                del _RECORDERS[i]
                break


def expert_bytes(
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> int:
    """Bytes of one expert's weights (and biases) in their stored dtype."""
    tensors = [t for t in (gate_up_proj, down_proj, gate_up_bias, down_bias) if t is not None]
    return sum(t[0].numel() * t.element_size() for t in tensors)


SUPPORTED_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Expert weight dtypes the kernel runs (operands stay in this dtype on a GPU). FP8 / int experts are refused:
their scales live outside ``gate_up_proj`` / ``down_proj`` and the kernel would silently ignore them."""


def check_weight_dtypes(prefix: str, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
    """One :class:`VatError` line (starting with ``prefix``) unless both expert weights share a dtype in
    :data:`SUPPORTED_WEIGHT_DTYPES`."""
    supported = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_WEIGHT_DTYPES)
    for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if w.dtype not in SUPPORTED_WEIGHT_DTYPES:
            raise VatError(
                f"{prefix}{name} is {str(w.dtype).removeprefix('torch.')}; the Triton experts kernel runs "
                f"{supported} expert weights — use experts_impl grouped_mm (or eager) for this target"
            )
    if gate_up_proj.dtype != down_proj.dtype:
        raise VatError(
            f"{prefix}gate_up_proj is {gate_up_proj.dtype} but down_proj is {down_proj.dtype}; the Triton experts "
            "kernel needs one weight dtype"
        )


def _check_devices(tensors: dict[str, torch.Tensor | None]) -> torch.device:
    """The common device of ``tensors`` (None entries ignored), or one :class:`VatError` line naming the odd one."""
    device = tensors["hidden_states"].device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise VatError(f"fused_experts: {name} is on {t.device} but hidden_states is on {device}")
    return device


def _check_shapes(hidden_states, gate_up_proj, down_proj, topk_ids, topk_weights, layout) -> tuple[int, int, int]:
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise VatError("gate_up_proj and down_proj must be 3-D (num_experts, out, in) tensors")
    num_experts = gate_up_proj.shape[0]
    if layout.is_transposed:
        hidden, two_i = gate_up_proj.shape[1:]
        down_expected = (num_experts, two_i // 2, hidden)
    else:
        two_i, hidden = gate_up_proj.shape[1:]
        down_expected = (num_experts, hidden, two_i // 2)
    if two_i % 2 or tuple(down_proj.shape) != down_expected:
        raise VatError(
            f"expert weight shapes do not match: gate_up_proj {tuple(gate_up_proj.shape)}, "
            f"down_proj {tuple(down_proj.shape)} (expected {down_expected})"
        )
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
        raise VatError(f"hidden_states must be (num_tokens, {hidden}), got {tuple(hidden_states.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden_states.shape[0]:
        raise VatError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
            f"(num_tokens={hidden_states.shape[0]}, top_k)"
        )
    return num_experts, hidden, two_i // 2


def fused_experts(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    layout: ExpertsLayout = STANDARD,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Mixture-of-experts forward that reads only the experts ``topk_ids`` selects (sentinel slots skipped).

    Inference only: there is no backward, so it refuses inputs that require grad while grad mode is on.

    Args:
        hidden_states: ``(T, H)`` token activations.
        gate_up_proj: ``(E, 2I, H)`` (``(E, H, 2I)`` if ``layout.is_transposed``).
        down_proj: ``(E, H, I)`` (``(E, I, H)`` if ``layout.is_transposed``).
        topk_ids: ``(T, k)`` integer expert ids in ``[0, E]``; ``E`` marks a dropped slot (weight ignored).
        topk_weights: ``(T, k)`` routing weights.
        gate_up_bias: optional ``(E, 2I)``.
        down_bias: optional ``(E, H)``.
        layout: weight layout and gated activation.
        config: explicit launch configuration; None autotunes on a GPU and uses :data:`INTERPRETER_CONFIG` under
            the interpreter.

    Returns:
        ``(T, H)`` in ``hidden_states.dtype``.

    Raises:
        VatError: CPU tensors without ``TRITON_INTERPRET=1``, inconsistent shapes, tensors on different devices,
            weight dtypes outside :data:`SUPPORTED_WEIGHT_DTYPES`, out-of-range ids, or grad required.
    """
    num_experts, hidden, inter = _check_shapes(hidden_states, gate_up_proj, down_proj, topk_ids, topk_weights, layout)
    check_weight_dtypes("fused_experts: ", gate_up_proj, down_proj)
    device = _check_devices(
        dict(
            hidden_states=hidden_states, gate_up_proj=gate_up_proj, down_proj=down_proj, topk_ids=topk_ids,
            topk_weights=topk_weights, gate_up_bias=gate_up_bias, down_bias=down_bias,
        )
    )  # fmt: skip
    on_gpu = hidden_states.is_cuda and not INTERPRETED
    if not on_gpu and not INTERPRETED:
        raise VatError(
            "the Triton experts kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before vat.kernels is imported "
            "to run on CPU); use target.experts_impl: eager on this machine"
        )
    tensors = [
        t for t in (hidden_states, gate_up_proj, down_proj, topk_weights, gate_up_bias, down_bias) if t is not None
    ]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise VatError("the Triton experts kernel has no backward: run the frozen target under torch.no_grad()")

    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    tuned = config is None and _gate_up_act_tuned is not None and on_gpu
    if config is None:
        config = KernelConfig() if on_gpu else INTERPRETER_CONFIG
    block_m = config.block_m or choose_block_m(num_pairs, num_experts)
    alignment = align_block_size(topk_ids, num_experts, block_m)
    if _RECORDERS:
        experts = tuple(alignment.experts_read())
        record = ExpertsRead(
            num_experts, experts, len(experts) * expert_bytes(gate_up_proj, down_proj, gate_up_bias, down_bias)
        )
        for calls in _RECORDERS:
            calls.append(record)
    if alignment.max_blocks == 0:  # no tokens
        return hidden_states.new_zeros(num_tokens, hidden)

    # Compute dtype: the weights' own on a GPU, fp32 under the interpreter (its bf16 arithmetic is wrong).
    dtype = gate_up_proj.dtype if on_gpu else torch.float32
    w1, w2 = gate_up_proj.to(dtype), down_proj.to(dtype)
    b1 = gate_up_bias.to(dtype) if gate_up_bias is not None else None
    b2 = down_bias.to(dtype) if down_bias is not None else None
    x = hidden_states.to(dtype)  # (T, H)
    flat_weights = topk_weights.reshape(-1).to(torch.float32 if not on_gpu else topk_weights.dtype)  # (P,)
    flat_weights = flat_weights.contiguous()
    act = torch.empty(num_pairs, inter, dtype=dtype, device=x.device)  # (P, I) rows of dropped pairs never read
    y = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)  # (P, H) dropped pairs stay 0

    # Triton launches on the *current* CUDA device and stream: make that the tensors' own (a target split with
    # device_map="auto" runs layers on several GPUs while the current device stays cuda:0)
    with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
        _launch_gate_up(x, w1, b1, act, alignment, num_experts, top_k, layout, config, tuned)
        _launch_down(act, w2, b2, flat_weights, y, alignment, num_experts, layout, config, tuned)
    out = y.view(num_tokens, top_k, hidden).sum(dim=1)  # (T, H) fp32 sum over the k slots
    return out.to(hidden_states.dtype)


def _weight_strides(w: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    """Strides of ``w`` seen as ``(E, N_out, K_in)`` whatever its stored orientation."""
    if transposed:
        return w.stride(0), w.stride(2), w.stride(1)
    return w.stride(0), w.stride(1), w.stride(2)


def _launch_gate_up(x, w1, b1, act, alignment: Alignment, num_experts, top_k, layout, config, tuned) -> None:
    inter = act.shape[1]
    hidden = x.shape[1]
    stride_we, stride_wn, stride_wk = _weight_strides(w1, layout.is_transposed)
    gate_step, up_offset = (1, inter) if layout.is_concatenated else (2, 1)
    bias = b1 if b1 is not None else w1
    args = (
        x, w1, bias, act, alignment.sorted_pair_ids, alignment.block_expert_ids,
        alignment.num_pairs, num_experts, inter, hidden,
        x.stride(0), x.stride(1), stride_we, stride_wn, stride_wk,
        bias.stride(0) if b1 is not None else 0, bias.stride(1) if b1 is not None else 0,
        act.stride(0), act.stride(1), gate_step, up_offset, float(layout.alpha), float(layout.limit),
    )  # fmt: skip
    meta = dict(
        TOP_K=top_k, ACTIVATION=_ACTIVATION_CODE[layout.activation], HAS_BIAS=b1 is not None,
        IEEE=w1.dtype == torch.float32, BLOCK_M=alignment.block_size,
    )  # fmt: skip
    kernel = _gate_up_act_tuned if tuned else _gate_up_act_kernel
    _launch(kernel, tuned, args, meta, alignment, config, out_extent=inter, reduce_extent=hidden)


def _launch_down(act, w2, b2, flat_weights, y, alignment: Alignment, num_experts, layout, config, tuned) -> None:
    hidden = y.shape[1]
    inter = act.shape[1]
    stride_we, stride_wn, stride_wk = _weight_strides(w2, layout.is_transposed)
    bias = b2 if b2 is not None else w2
    args = (
        act, w2, bias, flat_weights, y, alignment.sorted_pair_ids, alignment.block_expert_ids,
        alignment.num_pairs, num_experts, hidden, inter,
        act.stride(0), act.stride(1), stride_we, stride_wn, stride_wk,
        bias.stride(0) if b2 is not None else 0, bias.stride(1) if b2 is not None else 0,
        y.stride(0), y.stride(1),
    )  # fmt: skip
    meta = dict(HAS_BIAS=b2 is not None, IEEE=w2.dtype == torch.float32, BLOCK_M=alignment.block_size)
    kernel = _down_tuned if tuned else _down_kernel
    _launch(kernel, tuned, args, meta, alignment, config, out_extent=hidden, reduce_extent=inter)


def _launch(kernel, tuned: bool, args: tuple, meta: dict, alignment: Alignment, config, out_extent: int,
            reduce_extent: int) -> None:
    """Launch one of the two GEMM kernels over (aligned row blocks, output column tiles): the autotuned variant picks
    its own tiles; the fixed one takes ``config``'s, clamped to the extents (output N, reduction K)."""
    if tuned:
        kernel[lambda m: (alignment.max_blocks, triton.cdiv(out_extent, m["BLOCK_N"]))](*args, **meta)
        return
    block_n, block_k = _tile(config.block_n, out_extent), _tile(config.block_k, reduce_extent)
    grid = (alignment.max_blocks, triton.cdiv(out_extent, block_n))
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages) if not INTERPRETED else {}
    kernel[grid](*args, **meta, BLOCK_N=block_n, BLOCK_K=block_k, **launch)
