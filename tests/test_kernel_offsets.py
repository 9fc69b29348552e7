"""Row offsets past 2**31 elements (issue 14.1), under TRITON_INTERPRET=1 in fp32 on CPU, in seconds.

A row offset inside the kernels is ``row index × row stride``; with int32 arithmetic it wraps once it passes 2**31
elements — for the down kernel's fp32 output ``y (T·k, H)`` that is T·k·H ≥ 2**31, e.g. ~37 k tokens per forward at
DeepSeek-V3's hidden size. Reaching that through contiguous tensors would need ≥ 8 GiB of real memory and millions of
interpreted programs, so these probes reach the same offsets with a handful of rows placed 2**28-2**29 elements
apart in an *untouched* ``torch.empty`` storage (the OS commits only the pages the rows occupy; the interpreter
addresses the storage in place). Same arithmetic, same wrap: on int32 offsets a row lands ~16 GiB before its
storage, so the child process crashes or reads garbage, and the test fails either way.

Each probe runs in a child process so a wrapped address cannot take the test session down with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
INT32_LIMIT = 2**31
HIDDEN, INTER, NUM_EXPERTS, TOP_K, TOKENS = 32, 16, 2, 2, 5


def _spread_rows(rows: int, cols: int, row_stride: int) -> torch.Tensor:
    """A ``(rows, cols)`` fp32 view whose rows are ``row_stride`` elements apart, over an untouched storage."""
    storage = torch.empty((rows - 1) * row_stride + cols)  # virtual: only the rows written below are committed
    return storage.as_strided((rows, cols), (row_stride, 1))


def _problem():
    """Small experts, five tokens, both experts used by every token (so all ten pairs have rows)."""
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5  # (E, 2I, H)
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) * INTER**-0.5  # (E, H, I)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)  # (T, H)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])  # (T, k)
    weights = torch.rand(TOKENS, TOP_K, generator=gen)  # (T, k)
    return x, w1, w2, ids, weights


def _pair_rows(x, w1, w2, ids, weights):
    """Per-pair torch reference: ``act (P, I)`` and weighted ``y (P, H)``, pair p = token p // k, slot p % k."""
    flat = ids.reshape(-1)  # (P,)
    tokens = torch.arange(flat.numel()) // ids.shape[1]  # (P,)
    h = torch.einsum("ph,pnh->pn", x[tokens], w1[flat])  # (P, 2I)
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up  # (P, I)
    y = torch.einsum("pi,phi->ph", act, w2[flat]) * weights.reshape(-1, 1)  # (P, H)
    return act, y


def probe_hidden_states_rows() -> dict:
    """Token rows of ``hidden_states`` past 2**31 elements, through the public :func:`fused_experts`."""
    from vat.kernels.fused_moe import fused_experts
    from vat.kernels.reference import fused_experts_reference

    x, w1, w2, ids, weights = _problem()
    stride = 2**29 + 64  # last token's row starts at 4 * stride > 2**31
    spread = _spread_rows(TOKENS, HIDDEN, stride)
    spread.copy_(x)
    out = fused_experts(spread, w1, w2, ids, weights)
    ref = fused_experts_reference(x, w1, w2, ids, weights)
    return dict(last_offset=(TOKENS - 1) * stride, max_err=(out - ref).abs().max().item())


def probe_pair_rows() -> dict:
    """Pair rows of the activation cache and of the down kernel's output past 2**31 elements, launch by launch."""
    from vat.kernels.align import align_block_size
    from vat.kernels.fused_moe import KernelConfig, _launch_down, _launch_gate_up
    from vat.kernels.layout import STANDARD

    x, w1, w2, ids, weights = _problem()
    pairs = TOKENS * TOP_K
    stride = 2**28 + 32  # pairs 8 and 9 start past 2**31
    config = KernelConfig(block_m=16, block_n=32, block_k=32)
    alignment = align_block_size(ids, NUM_EXPERTS, 16)
    act = _spread_rows(pairs, INTER, stride)  # (P, I)
    y = _spread_rows(pairs, HIDDEN, stride)  # (P, H)
    y.zero_()
    _launch_gate_up(x, w1, None, act, alignment, NUM_EXPERTS, TOP_K, STANDARD, config, False)
    _launch_down(act, w2, None, weights.reshape(-1), y, alignment, NUM_EXPERTS, STANDARD, config, False)
    act_ref, y_ref = _pair_rows(x, w1, w2, ids, weights)
    return dict(
        last_offset=(pairs - 1) * stride,
        act_err=(act - act_ref).abs().max().item(),
        y_err=(y - y_ref).abs().max().item(),
    )


def _run_probe(name: str) -> dict:
    """Run ``probe_<name>`` in a fresh interpreter-mode process; its JSON result, or a failure with its stderr."""
    code = f"import json, test_kernel_offsets as t; print(json.dumps(t.probe_{name}()))"
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"probe {name} exited with {proc.returncode} (a wrapped int32 offset?):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_hidden_states_rows_past_int32():
    result = _run_probe("hidden_states_rows")
    assert result["last_offset"] >= INT32_LIMIT
    assert result["max_err"] <= 1e-5


def test_activation_and_output_rows_past_int32():
    result = _run_probe("pair_rows")
    assert result["last_offset"] >= INT32_LIMIT
    assert result["act_err"] <= 1e-5
    assert result["y_err"] <= 1e-5


def test_spread_rows_stay_virtual():
    """The probes' premise: a spread view commits only the pages its rows touch (else they would need 8+ GiB)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    view = _spread_rows(TOKENS, HIDDEN, 2**29 + 64)
    view.fill_(1.0)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert view.untyped_storage().nbytes() >= 8 * 2**30
    assert grown_mib < 64
